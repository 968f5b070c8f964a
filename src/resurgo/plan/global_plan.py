"""The coordinator's save plan for a distributed job: one tree, every tensor covered exactly once,
each replicated chunk written by one rank, bytes balanced across ranks.

Pure data in, pure data out: every rank sends a :class:`RankDecl` (its tree and, per tensor, the
places it holds; metadata only, never tensor data), :func:`plan_global` validates and decides,
and every rank gets the same :class:`GlobalPlan` back. Values that differ between ranks become
``per_rank`` nodes of the tree (their tensors saved once per rank, under ``key@rankN``) instead of
collapsing into one copy.

Repeated saves of one layout send less: every rank keeps the last plan it received
(:meth:`PlanCache.hold`) and sends a :class:`RankSummary` (fixed-size fingerprints plus its values
at the tree's per-rank places, at most :data:`SMALL_VALUES_BYTES`); the coordinator reuses the last
plan from the summaries alone (:meth:`PlanCache.reuse`) or asks every rank for its full
:class:`RankDecl`.

This module is the entry point and the names' home for callers; the parts live in
:mod:`~resurgo.plan.global_types` (the data), :mod:`~resurgo.plan.global_checks` (validation and
the tree merge), :mod:`~resurgo.plan.global_assign` (chunks and their assignment) and
:mod:`~resurgo.plan.plan_cache` (reuse of the last plan).
"""

from __future__ import annotations

from collections.abc import Callable

from resurgo.gcpause import collector_paused
from resurgo.plan.global_assign import REGULAR_FROM, Chunks, listed_chunks, plan_tensors, regular_chunks
from resurgo.plan.global_checks import merge_declared, merge_trees
from resurgo.plan.global_types import (GlobalPlan, PlanWrites, RankDecl, RankWrite, TensorDecl, TensorMeta,
                                       layout_fingerprint)
from resurgo.plan.plan_cache import SMALL_VALUES_BYTES, PlanCache, RankSummary, per_rank_places

__all__ = ["REGULAR_FROM", "SMALL_VALUES_BYTES", "Chunks", "GlobalPlan", "PlanCache", "PlanWrites", "RankDecl",
           "RankSummary", "RankWrite", "TensorDecl", "TensorMeta", "layout_fingerprint", "listed_chunks",
           "merge_trees", "per_rank_places", "plan_global", "regular_chunks"]


def plan_global(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int],
                regular_from: int = REGULAR_FROM) -> GlobalPlan:
    """Validate every rank's declarations and decide who writes what (see the module docstring).

    ``block_bytes_for(global_nbytes, row_bytes)`` gives the checksum block size of a tensor's chunks
    (``row_bytes``: the bytes of one index of its first dimension).
    Raises ShardingError naming the tensor and the ranks when the shards do not fit together.

    From ``regular_from`` ranks on, each tensor's chunks are first looked for as a grid with one
    holder per chunk, with arrays (:func:`regular_chunks`); the tensors that are not, and smaller
    jobs, take the general path (:func:`listed_chunks`). Both give the same plan.
    """
    with collector_paused():  # an object per chunk, all kept: see resurgo.gcpause
        tree, per_rank, own = merge_declared(decls)
        return plan_tensors(decls, block_bytes_for, tree, per_rank, regular_from, own)
