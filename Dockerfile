# One image for every service of a dpfl federation: flower-superlink, flower-supernode and the
# flower-superexec processes that run the ServerApp and the ClientApps (docker-compose.yml).
# The base is a build argument: any Debian-like image with Python 3.11, python3-venv and pip.
ARG BASE_IMAGE=python:3.11-slim

# the dependency list alone, so that the layer that installs it (torch included) is rebuilt
# only when the list changes, not when the code, the docs or the run-config defaults do
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml /
RUN python3 -c "import tomllib; deps = tomllib.load(open('/pyproject.toml', 'rb'))\
['project']['dependencies']; open('/requirements.txt', 'w').write('\n'.join(deps) + '\n')"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    DPFL_DATA_DIR=/data \
    PATH=/opt/dpfl/bin:$PATH
RUN python3 -m venv /opt/dpfl
WORKDIR /app
COPY --from=requirements /requirements.txt ./
RUN pip install -r requirements.txt
COPY pyproject.toml README.md LICENSE ./
COPY dpfl ./dpfl
# any user may run it (compose runs the ServerApp as the invoking user, so that the results it
# writes to a bind mount are theirs); /app/state is where compose keeps a node's ledgers
ENV FLWR_HOME=/tmp/flwr HOME=/tmp
RUN pip install --no-deps . && mkdir -p /data /app/results /app/state \
    && chmod 1777 /app/results /app/state
USER 1000:1000
