"""Hyperparameter selection: the one tuning protocol of every paper's reproductions.

An experiment tunes each cell of a paper's table (a model, a method, a privacy level) by
composing these building blocks; what differs between the experiments is a parameter of a
block, never a copy of one:

* **grid** (:mod:`.grids`): :func:`grid`, the product of axes; :func:`edge_axes`, a point's
  axes on the grid's edge (a selection there is weaker than an interior one); the points next to
  one, inside the grid (:func:`neighbours`, on any axes at once; :func:`axis_neighbours`, on
  one) or past its edge (:func:`past_edge`).
* **rank** (:mod:`.ranking`): a :class:`Ranking` is a run's metric (higher or lower better),
  the mean over a point's seeds, a non-finite mean last, and one tie rule: the ranking's
  ``then`` metric, else the order the points were given in (the first wins). Points are ranked
  on the server's test set by default, the papers' protocol (:func:`accuracy`); ``split=
  "validation"`` ranks them on the validation split held out of the training data (dataset
  option ``num_validation``), for a selection that must not see the test set.
  :func:`best` and :func:`ranked` apply it.
* **successive halving** (:mod:`.halving`): :func:`halving`, rungs of growing length, each
  keeping what its ``keep`` says (:func:`top`: the best k), and :func:`confirmation`, a last
  full-length rung that reruns the first rung's best and other candidates (the neighbouring
  cells' winners) so that no proxy rung decides alone; :func:`select`, the step ladder on
  it: points kept by *step size* (:func:`survivors`), runs that end identically once, the last
  rung hedged towards smaller steps, below the grid while the smallest step wins
  (:func:`smaller_steps`), and its :func:`seed_runs`.
* **a walk past the grid's edge** (:mod:`.walks`): :func:`walk_past_edges`, × or ÷ a factor
  per axis while the mean over the seeds improves; :func:`walk_past_edge` along one axis.
* **a local search at one or more tuning seeds** (:mod:`.search`): :class:`Search`, every grid
  neighbour of a cell's best until it is interior to what was searched.
* **confirmation and seed runs** (:mod:`.runs`): a :class:`Runner` runs a cell's point at a
  seed; :meth:`Runner.on_seeds` runs each cell's chosen point on tuning seeds (a
  confirmation, then ranked with :func:`best`) or on fresh seeds (the reported runs).
* **paired intervals** (:mod:`.intervals`): :func:`mean_std`, :func:`paired`, :func:`decided`.

How each experiment composes them (the reported accuracies are always the test set's):

* ``clip21 mnist-dp*``, ``partial*``: :func:`select` by test accuracy, :func:`seed_runs`;
  ``clip21 logreg``: the whole (γ, β) grid on three seeds ranked by the mean gradient norm
  (:func:`best`), then :func:`walk_past_edge` along γ.
* ``benchmark epsilon``: :func:`halving` with :func:`top` rungs, then a :func:`confirmation`
  of the first rung's best 4 and the neighbouring ε's winners, ranked by validation accuracy
  then validation loss; fresh seeds by :meth:`Runner.on_seeds`. ``secagg gain`` and ``pcdp
  *-tuned``: one grid axis at a selection seed ranked by validation accuracy, the axis in
  increasing order (a tie takes the smaller step).
* ``prisma least-squares*``: a coarse :func:`grid` and a :class:`Search` at tuning seed 0
  (``-hardened``, ``-equal``: on the mean over seeds 0–2) per (method, N, T), each T's best
  confirmed on the tuning seeds and the T of the lowest mean taken (:func:`best`); ``-equal``
  bounds each cell's search by a budget and walks PriSMA's grid by :func:`axis_neighbours`;
  ``prisma cifar10``: the best of a grid at one seed by test accuracy
  (:func:`ranked`).
* ``adaptive t*``: the grid on two seeds ranked by the mean lowest training loss, then
  :func:`walk_past_edges` on (η, C); ``adaptive interpolation``: the best grid point of each
  model reading by the same ranking.
"""

from dpfl_reproductions.selection.grids import (
    BELOW_GRID,
    Cell,
    Config,
    axis_neighbours,
    edge_axes,
    grid,
    grid_floor,
    neighbours,
    past_edge,
)
from dpfl_reproductions.selection.halving import (
    CONFIRMATION,
    Keep,
    Rung,
    StepLadder,
    StepRung,
    confirmation,
    halving,
    same_end,
    seed_runs,
    select,
    smaller_steps,
    survivors,
    top,
)
from dpfl_reproductions.selection.intervals import LEVEL, Paired, decided, mean_std, paired
from dpfl_reproductions.selection.ranking import (
    Ranking,
    Split,
    Summary,
    accuracy,
    best,
    final_accuracy,
    final_loss,
    ranked,
)
from dpfl_reproductions.selection.runs import Runner, Runs, command
from dpfl_reproductions.selection.search import Neighbourhood, Search, point_key
from dpfl_reproductions.selection.walks import Walked, walk_past_edge, walk_past_edges

__all__ = [
    "BELOW_GRID", "CONFIRMATION", "Cell", "Config", "Keep", "LEVEL", "Neighbourhood", "Paired",
    "Ranking", "Rung", "Runner", "Runs", "Search", "Split", "StepLadder", "StepRung", "Summary",
    "Walked", "accuracy", "axis_neighbours", "best", "command", "decided", "edge_axes",
    "final_accuracy", "final_loss", "grid", "grid_floor", "halving", "mean_std", "neighbours",
    "paired", "past_edge", "point_key", "ranked", "same_end", "seed_runs", "select",
    "smaller_steps", "survivors", "top", "walk_past_edge", "walk_past_edges",
]
