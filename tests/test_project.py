"""The project surface: every run-config key is in pyproject.toml and documented in
docs/configuration.md, every relative link in the documentation points to a file and to a
heading of it where it names one, the core imports nothing from Flower, and no class is over
about 300 lines."""

from __future__ import annotations

import ast
import re
import tomllib

import pytest

from dpfl.runconfig import RunConfig, all_params, defaults
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and [text](target "title"); images too
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.cpu_only("the option changes the default of key device")
def test_pyproject_lists_every_key_with_its_default():
    flwr_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"]
    assert flwr_config == defaults()


def test_docs_document_every_key():
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in all_params() if f"`{k}`" not in reference]
    assert not missing, missing


def local_links(path):
    """``(file, anchor)`` of each link of a Markdown file that is not a URL (http:, https:,
    mailto: ...): ``file`` relative to it ("" for its own), ``anchor`` "" where it names none
    (code spans and fenced blocks excluded)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in LINK.findall(text):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            file, _, anchor = target.partition("#")
            yield file, anchor


def relative_links(path):
    """Relative link targets of a Markdown file, without their #anchor."""
    return [file for file, _ in local_links(path) if file]


def test_docs_link_checker_finds_links():
    assert "docs/configuration.md" in set(relative_links(ROOT / "README.md"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_a_file_that_exists(doc):
    broken = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert not broken, broken


def anchors(path):
    """The anchors GitHub gives ``path``'s headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``; a repeated one numbered ``-1``, ``-2``, ..."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        yield slug if count == 0 else f"{slug}-{count}"


def test_anchors_follow_githubs_rule(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `key`, ε = 2 (x/y)\n## Repeat\n## Repeat\n```\n# not a heading\n```\n")
    assert list(anchors(page)) == ["a-key-ε--2-xy", "repeat", "repeat-1"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_to_a_heading_finds_it(doc):
    broken = [f"{file}#{anchor}" for file, anchor in local_links(doc)
              if anchor and (where := doc.parent / file if file else doc).suffix == ".md"
              and where.exists() and anchor not in set(anchors(where))]
    assert not broken, broken


def test_torchvision_imports_and_runs_an_op():
    import torch
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.5, 0.5, 2.0, 2.0], [5.0, 5.0, 6.0, 6.0]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
    assert keep.tolist() == [0, 2]


#: the Flower-free core: Flower's runtimes drive it through a transport, never the other way
FLOWER_FREE = ("algorithms", "privacy", "models", "rounds", "datasets", "engine")
MAX_CLASS_LINES = 320  # "small modules named for what they hold": no class much over 300


def _sources():
    return sorted((ROOT / "dpfl").rglob("*.py"))


def test_the_core_imports_nothing_from_flower():
    offenders = []
    for path in _sources():
        if path.relative_to(ROOT / "dpfl").parts[0] not in FLOWER_FREE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                          if name == "flwr" or name.startswith("flwr.")]
    assert not offenders


def test_the_library_never_imports_the_reproductions():
    """``dpfl_reproductions`` is a client of the library: only the ``reproduce`` command names
    it (inside the function that runs it)."""
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for name in names
                          if name.split(".")[0] == "dpfl_reproductions"]
    assert len(offenders) == 2 and all(o.startswith("dpfl/cli.py:") for o in offenders)


def test_no_class_is_over_about_300_lines():
    sizes = {f"{path.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
             for path in _sources() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef)}
    assert sizes and {k: v for k, v in sizes.items() if v > MAX_CLASS_LINES} == {}


#: where the flat run configuration is read by key: the parser (the reproductions, which compose
#: configurations as a caller does, live outside the package)
PARSER = ("runconfig.py",)


def test_no_module_below_the_parser_reads_a_run_config_key():
    """The run config is parsed once (:class:`dpfl.runconfig.RunConfig`) into typed settings;
    below the parser a module reads ``config.privacy.epsilon``, never ``config["epsilon"]``
    (nor ``.get("epsilon")``) on a run configuration (a node's own config is another
    vocabulary)."""
    keys = set(all_params())
    offenders = []
    for path in _sources():
        if path.relative_to(ROOT / "dpfl").parts[0] in PARSER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript):
                target, key = node.value, node.slice
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "get" and node.args):
                target, key = node.func.value, node.args[0]
            else:
                continue
            name = ast.unparse(target)
            if (isinstance(key, ast.Constant) and key.value in keys
                    and re.search(r"(config|cfg)$", name) and "node_config" not in name):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}[{key.value!r}]")
    assert offenders == []


def test_every_common_key_lies_in_exactly_one_settings_group():
    from dpfl.config import COMMON
    from dpfl.settings import GROUPS, keys_of

    grouped = [key for group in GROUPS for key in keys_of(group)]
    assert sorted(grouped) == sorted(p.key for p in COMMON)
    config = RunConfig({"epsilon": 3.0, "secure-aggregation": True, "num-partitions": 4})
    assert (config.privacy.epsilon, config.secure.secure_aggregation,
            config.data.num_partitions) == (3.0, True, 4)


def test_nothing_reads_a_folder_beside_the_checkout():
    """Users have no folder beside their checkout: the code, the suite, the benchmarks and the
    Makefile read the datasets from ``$DPFL_DATA_DIR``, else dpfl's per-user data folder (only
    CI's own script, ``.ci/run``, knows where CI keeps its copy)."""
    beside = re.compile(r"\b(?:ROOT|REPO)\.parent\s*/|\.\./shared")
    files = [ROOT / "Makefile", *(p for folder in ("dpfl", "tests", "benchmarks")
                                  for p in (ROOT / folder).rglob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if beside.search(line)]
    assert files and found == []
