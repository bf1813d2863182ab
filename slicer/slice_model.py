"""Slice an ONNX model into time-balanced, verified stages and write a model directory.

Steps (paper §7.1): load and check the model; find legal cut points; profile node costs;
choose time-balanced cuts; cut; measure the stages and re-balance with the measured costs;
verify that the stages run in order equal the original; profile each stage over batch sizes
and length buckets; write the directory. With `stages=None` the number of stages is chosen
among candidates by measuring each candidate pipeline. Everything is built in a temporary
folder beside the output and moved into place at the end: a failure leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
from collections import Counter
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from dvabatch_backend.runtime.engine import available_cores
from dvabatch_backend.runtime.loading import MODEL_SPINNING, STAGE_SPINNING
from dvabatch_backend.runtime.manifest import Manifest, TensorSpec
from dvabatch_backend.runtime.settings import RuntimeSettings

from .analysis import CutPoint, legal_cut_points, name_nodes, with_length_carrier
from .axes import (DENSE_RULE_LENGTHS, AxisOverrides, LengthRule, batch_first_outputs, canonical_model,
                   discover_axes, length_rule, probe_lengths, runnable_lengths)
from .cut import cut_model, input_specs, output_dims, output_strides, probe_settings, set_probe_lengths
from .errors import SliceError, one_line
from .pad_safety import PadSafety, check_pad_safety, output_atol
from .precision import FP32, Precision, check_outputs, convert, convert_stages, precision
from .plots import write_stage_plot
from .partition import NoLegalCut, Partition, achievable_balance, balanced_partition
from .preflight import check_proto, full_session, probe_max_length, read_model
from .sessions import external_data_dir
from .profiler import Setting, int_bounds, node_costs, random_inputs, time_after_gaps, time_stages
from .stage_profile import default_batch_sizes, default_lengths, profile_stages, stage_times_at
from .gpu_config import gpu_config
from .serving_engine import PAIR_CANDIDATES, ServingEngine
from .triton_files import VERSION_DIR, write_triton_files

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SliceOptions:
    stages: int | None = None  # None: choose among `candidates` by measurement
    # 1: the whole model as one stage, served by the same runtime; tried for fixed-shape models only
    # (a variable-length model's stages let short queries exit early, which a throughput measurement
    # of one length cannot show)
    candidates: tuple[int, ...] = (1, 2, 3, 4)
    name: str | None = None  # default: the output folder's name
    max_batch_size: int = 64
    max_length: int = 128  # for models with a sequence dimension
    threads: int = 1  # onnxruntime threads for node costs and stage balancing
    # threads of the stage profile and the fast path's timing: by default every core, as each stage
    # runs served (the policies plan with these times)
    profile_threads: int | None = None
    batch_sizes: tuple[int, ...] | None = None  # stage profile; default 1, 2, 4, ... up to max_batch_size (<= 64)
    lengths: tuple[int, ...] | None = None  # stage profile length buckets
    reference_batch: int = 8  # node costs and balance are measured at this batch size
    reference_length: int | None = None  # default: the middle length bucket
    repeats: int = 10
    atol: float = 1e-4
    operator_diversity_cuts: bool = False  # move cuts to where the preferred batch size changes
    max_boundary_tensors: int = 8
    calibration_rounds: int = 6
    balance_goal: float = 1.10  # stop re-balancing once the slowest stage over the mean is at most this
    force: bool = False  # replace an existing output directory
    axes: AxisOverrides = AxisOverrides()  # --batch-axis, --variable-axis, --fixed
    # the engine and device that will serve, which time the stages (slicer/serving_engine.py); the
    # default, onnxruntime on the CPU, is timed by slicer/profiler.py
    serving: ServingEngine = ServingEngine()
    # the stages' and the unsliced model's floats: fp32 as exported, or fp16 / bf16 (slicer/precision.py)
    precision: str = "fp32"


@dataclass
class Candidate:
    stages: int
    dir: Path  # the version folder
    manifest: Manifest
    partition: Partition
    stage_seconds: list[float]
    verify_error: float = 0.0
    throughput: float | None = None

    @property
    def balance(self) -> float:
        return max(self.stage_seconds) / (sum(self.stage_seconds) / len(self.stage_seconds))


@dataclass
class SliceReport:
    out_dir: Path
    manifest: Manifest
    chosen: Candidate
    reference: Setting
    profile: dict[str, Any]
    candidates: list[Candidate] = field(default_factory=list)
    legal_points: int = 0
    nodes: int = 0
    achievable: dict[int, float] = field(default_factory=dict)  # stage count -> best balance by node costs
    balance_goal: float = 1.25
    illegal: dict[str, int] = field(default_factory=dict)  # why the other positions are illegal: kind -> count

    def summary(self) -> str:
        c = self.chosen
        lines = [
            f"sliced {self.manifest.name} into {c.stages} stages -> {self.out_dir}",
            f"  cuts after nodes {list(c.partition.positions)}; crossing tensors "
            f"{[list(p.tensors) for p in c.partition.cuts]}",
            f"  stage times at batch {self.reference.batch}, length {self.reference.length}: "
            + ", ".join(f"{t * 1e3:.3f} ms" for t in c.stage_seconds)
            + f"  (slowest / mean = {c.balance:.2f})",
            (f"  verified against the original: max |error| {c.verify_error:.2e}"
             if "precision" not in self.manifest.extra.get("slicing", {}) else
             f"  verified against the fp32 original: max |error| {c.verify_error:.2e} of each output's "
             "largest magnitude"),
            "  pad-safe: " + ("yes" if self.manifest.pad_safe
                              else "NO — queries are batched only with queries of the same length "
                                   f"({self.manifest.extra.get('slicing', {}).get('pad_check', '')})"),
        ]
        for stage in self.profile["stages"]:
            lines.append(f"  {stage['file']}: preferred batch size {stage['preferred_bs']}")
        div = self.profile["diversity"]
        lines.append(f"  diversity: input {'yes' if div['input'] else 'no'}, operator "
                     f"{'yes' if div['operator'] else 'no'}, load yes")
        policy = self.manifest.extra.get("policy", {})
        if policy:
            lines.append(f"  policy: {policy.get('choice')} ({policy.get('why')})")
        fast_path = self.manifest.extra.get("fast_path", {})
        if fast_path:
            lines.append(f"  fast path (a query that meets nobody): {fast_path.get('why')}")
        slicing = self.manifest.extra.get("slicing", {})
        if "engine" in slicing:
            lines.append(f"  timed on {slicing['engine']['engine']}, {slicing['engine']['device']} "
                         f"({self.manifest.extra.get('profiled_on', 'cpu')})")
        if "precision" in slicing:
            p = slicing["precision"]
            lines.append(f"  precision {p['precision']}: error against the fp32 model, over each output's largest "
                         f"magnitude, {p['model_error']:.2e} unsliced, {p['stages_error']:.2e} the stages in a row "
                         f"(tolerance {p['tolerance']:.2e}); inputs, outputs and the stages' boundaries as exported")
        if "buffer_pairs" in slicing:
            lines.append(f"  buffer pairs: {slicing['buffer_pairs']['chosen']} ({slicing['buffer_pairs']['why']})")
        if len(self.candidates) > 1:
            lines.append("  stage-count candidates (queries/s as served, closed loop): "
                         + ", ".join(f"{x.stages}: {x.throughput:.0f}" for x in self.candidates)
                         + f"; chose {c.stages} (the fewest stages within {STAGE_COUNT_TIE:.0%} of the fastest)")
        if self.manifest.length_rule:
            lines.append(f"  lengths the model takes: multiples of {self.manifest.length_multiple}, at least "
                         f"{self.manifest.min_length} ({self.manifest.length_rule})")
        lines.append(f"  legal cut points: {self.legal_points} of {self.nodes} node positions")
        if self.illegal:
            lines.append("  illegal positions: " + "; ".join(f"{n} where {kind}" for kind, n in self.illegal.items()))
        if c.balance > self.balance_goal:
            bound = self.achievable.get(c.stages)
            fits = [n for n, b in sorted(self.achievable.items()) if n > 1 and b <= self.balance_goal]
            lines.append(
                f"  NOT BALANCED: the slowest stage is {c.balance:.2f}x the mean; "
                + (f"by node costs the legal cuts allow at best {bound:.2f} for {c.stages} stages (a run of nodes "
                   f"no legal cut divides dominates); " if bound is not None else "")
                + (f"{max(fits)} stages or fewer balance within {self.balance_goal:.2f}, which --stages auto "
                   f"considers" if fits else f"no stage count balances within {self.balance_goal:.2f}"))
        return "\n".join(lines)


def load_model(source: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """Load and check a model; a file that is not a whole, valid ONNX model is a SliceError."""
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        check_proto(model)
    else:
        model = read_model(Path(source))  # external data loaded; opset and checker (by path over 2 GB)
    return name_nodes(model)


def slice_model(source: str | Path | onnx.ModelProto, out_dir: str | Path, options: SliceOptions = SliceOptions(),
                progress: Progress | None = None) -> SliceReport:
    out_dir = Path(out_dir)
    say = progress or (lambda message: None)
    if out_dir.exists() and any(out_dir.iterdir()) and not options.force:
        raise SliceError(f"{out_dir} exists and is not empty (use force to replace it)")
    to = precision(options.precision)
    model = load_model(source)
    name = options.name or out_dir.name
    try:
        axes = discover_axes(model, options.axes)
        model = canonical_model(model, axes)
        inputs = list(input_specs(model).values())
        has_seq = any(s.has_seq for s in inputs)
        max_length = options.max_length if has_seq else 0
        rule = LengthRule()
        if has_seq:  # the longest length first: a position table's limit is named as such
            probe_max_length(full_session(model), inputs, max_length, int_bounds(model))
            say(f"running the model at every length up to {min(max_length, DENSE_RULE_LENGTHS)} and a spread to "
                f"{max_length}: the lengths it takes")
            rule = length_rule(model, max_length, output_strides(model), output_dims(model))
            set_probe_lengths(model, probe_lengths(model, max_length, rule))
        moved = batch_first_outputs(model, probe_settings(model)[0][1] if has_seq else 0)
    except ValueError as exc:
        raise SliceError(str(exc)) from exc
    if rule.why:
        say(f"lengths: multiples of {rule.multiple}, at least {rule.min_length}: {rule.why}")
    say(f"axes: {axes.describe()}" + "".join(f"; output {k}: batch axis {v} (served in that layout)" for k, v in moved.items()))
    if not has_seq:  # a model with a length ran at its longest above, before its length rule
        say("running one query")
        probe_max_length(full_session(model, options.threads), inputs, max_length, int_bounds(model))
    lengths = [n for n in options.lengths or runnable_lengths(model, default_lengths(max_length), rule.multiple)
               if rule.allows(n) or not has_seq]
    if not lengths:
        raise SliceError(f"none of the lengths to profile is one the model takes ({rule.why})")
    batch_sizes = list(options.batch_sizes or default_batch_sizes(options.max_batch_size))
    ref = Setting(min(options.reference_batch, options.max_batch_size),
                  options.reference_length or (lengths[len(lengths) // 2] if has_seq else 0))
    say("finding legal cut points")
    illegal: Counter[str] = Counter()
    points = legal_cut_points(model, ref.length, options.max_boundary_tensors, illegal)
    carried = with_length_carrier(model) if has_seq else None
    if carried is not None:  # keep it only where it makes more positions legal
        carried_illegal: Counter[str] = Counter()
        carried_points = legal_cut_points(carried, ref.length, options.max_boundary_tensors, carried_illegal)
        if len(carried_points) > len(points) + 1:
            say(f"a length carrier makes {len(carried_points) - 1} positions legal instead of {len(points)}")
            model, points, illegal = name_nodes(carried), carried_points, carried_illegal
    half = _half_model(model, to, inputs, lengths, options, say)
    wanted = [options.stages] if options.stages is not None else [
        n for n in options.candidates if n - 1 <= len(points) and (n > 1 or not has_seq)]
    for n in wanted:
        _check_stage_count(n, len(model.graph.node), points)
    settings = [ref] + ([Setting(1, ref.length), Setting(max(batch_sizes), ref.length)] if options.operator_diversity_cuts else [])
    costs_at = node_costs(model, inputs, settings, options.threads, options.repeats, say)
    preferred = _diversity_points(costs_at, settings, points) if options.operator_diversity_cuts else set()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as tmp:
        candidates = [
            _build_candidate(model, name, n, costs_at[ref], points, preferred, ref, lengths, max_length,
                             Path(tmp) / f"n{n}", options, say, half)
            for n in wanted
        ]
        concurrency = min(16, options.max_batch_size)
        _expect(say, _steps_left(candidates, lengths, options))
        if len(candidates) > 1:
            measure_candidates(candidates, ref.length, int_bounds(model), concurrency, say, settings=_served(options))
        chosen = choose_stage_count(candidates)
        pairs = (choose_buffer_pairs(chosen, ref.length, int_bounds(model), concurrency, options, say)
                 if options.serving.shares_a_device and chosen.stages > 1 else None)
        _expect(say, 1 + _profile_steps(chosen, lengths, options) + _fast_path_steps(chosen, model))
        say("checking that padding leaves answers unchanged")
        # a session of the whole model only while it is used: a large model's weights, once at a time
        pad = check_pad_safety(full_session(model, options.threads), inputs, chosen.manifest.outputs, max_length,
                               options.atol, int_bounds(model))
        served_threads = options.profile_threads or available_cores()
        device = "cpu"
        if options.serving.is_default:
            profile = profile_stages(chosen.dir, chosen.manifest, batch_sizes, lengths, served_threads,
                                     max(3, options.repeats // 2), int_bounds(model), say)
        else:
            say(f"profiling the stages on {options.serving.engine}, {options.serving.device}, at its graph buckets")
            profile, device = options.serving.profile(chosen.dir, chosen.manifest, int_bounds(model),
                                                      max(3, options.repeats // 2))
        policy = _policy_choice(profile)
        if external_data_dir(model) is not None:  # over 2 GB: a second copy of the weights is not offered
            fast_path = {"engine": "stages", "why": "the model is over 2 GB: the stages in a row, no second copy of "
                                                    "its weights beside them", "seconds": {}}
        elif chosen.manifest.num_stages == 1:  # the one stage is the whole model: nothing to choose
            fast_path = {"engine": "stages", "why": "one stage, the whole model: nothing to time against it",
                         "seconds": {}}
        else:
            say("timing the unsliced model beside the stages in a row (the fast path's engine)")
            fast_path = (fast_path_choice(chosen.dir, chosen.manifest, lengths, served_threads, int_bounds(model))
                         if options.serving.is_default else
                         fast_path_record(options.serving.fast_path_seconds(chosen.dir, chosen.manifest,
                                                                            int_bounds(model), options.repeats),
                                          f"one query on {options.serving.engine}, {options.serving.device}"))
        manifest = _final_manifest(chosen, profile, ref, options, pad, int_bounds(model), policy, fast_path,
                                   _stage_count_record(candidates, chosen, has_seq, options.stages,
                                                       _measured_on(options.serving)), rule,
                                   device=device, buffer_pairs=pairs, half=half)
        _write_profile(chosen.dir, manifest, profile)
        write_stage_plot(chosen.dir, manifest, candidates)
        _write_config(chosen.dir.parent, manifest, policy["choice"], options.serving)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        chosen.dir.parent.rename(out_dir)
    chosen.dir = out_dir / VERSION_DIR
    achievable = {n: achievable_balance(costs_at[ref], points, n) for n in sorted({2, 3, 4, chosen.stages})}
    return SliceReport(out_dir, manifest, chosen, ref, profile, candidates, len(points), len(model.graph.node),
                       achievable, illegal={k: v for k, v in illegal.most_common() if v})


def _expect(say: Progress, steps: int) -> None:
    """Tell a progress that counts steps how many are left (`tools.progress.StepProgress.expect`)."""
    expect = getattr(say, "expect", None)
    if callable(expect):
        expect(steps)


def _steps_left(candidates: Sequence[Candidate], lengths: Sequence[int], options: SliceOptions) -> int:
    """The steps the slicer announces once the candidates are cut: each candidate's measuring rounds
    (where there is a choice), the buffer pairs' rounds (stages sharing a device), the padding check,
    the profile (of the candidate with the most stages: the chosen one is known later, and the count
    is set again then) and the fast path's timing."""
    measuring = len(candidates) * MEASURE_ROUNDS if len(candidates) > 1 else 0
    pairs = len(PAIR_CANDIDATES) * MEASURE_ROUNDS if options.serving.shares_a_device else 0
    most = max(candidates, key=lambda c: c.stages)
    return measuring + pairs + 1 + _profile_steps(most, lengths, options) + 1


def _profile_steps(chosen: Candidate, lengths: Sequence[int], options: SliceOptions) -> int:
    """The steps the profile announces: one per stage and length on the default engine, else one."""
    return chosen.stages * max(len(lengths), 1) if options.serving.is_default else 1


def _fast_path_steps(chosen: Candidate, model: onnx.ModelProto) -> int:
    """1 where the unsliced model is timed beside the stages in a row (`slice_model`), else 0."""
    return int(chosen.manifest.num_stages > 1 and external_data_dir(model) is None)


def _check_stage_count(n: int, node_count: int, points: list[CutPoint]) -> None:
    try:
        balanced_partition(np.ones(node_count), points, n)
    except NoLegalCut as exc:
        raise SliceError(str(exc)) from exc
    except ValueError as exc:
        raise SliceError(str(exc)) from exc


def _build_candidate(model: onnx.ModelProto, name: str, n: int, costs: np.ndarray,
                     points: list[CutPoint], preferred: set[int], ref: Setting, lengths: list[int], max_length: int,
                     work: Path, options: SliceOptions, say: Progress, half: HalfModel | None = None) -> Candidate:
    """Cut into `n` stages (in `half`'s precision, where given); re-balance with measured stage
    times; verify the best cut."""
    best: Candidate | None = None
    candidates: list[Candidate] = []
    tried: set[tuple[int, ...]] = set()
    evidence: list[tuple[int, int, float]] = []  # (first node, end node, measured seconds) of every stage cut
    calibrated = costs
    for round_ in range(options.calibration_rounds + 1):
        part = balanced_partition(calibrated, points, n, preferred=preferred)
        if part.positions in tried:
            break
        tried.add(part.positions)
        say(f"cutting into {n} stages at {list(part.positions)}")
        folder = work / f"round{round_}" / VERSION_DIR
        manifest = cut_model(model, part.positions, folder, name, options.max_batch_size, max_length)
        if half is not None:  # timed, as served, in the precision that will serve
            convert_stages(folder, [s.file for s in manifest.stages], str(manifest.full_model), half.model, half.to)
        seconds = _stage_seconds(folder, manifest, ref, options, int_bounds(model), options.repeats)
        cand = Candidate(n, folder, manifest, part, seconds)
        candidates.append(cand)
        if best is None or cand.balance < best.balance:
            best = cand
        if cand.balance <= options.balance_goal:
            break
        bounds = [0, *part.positions, len(costs)]
        evidence += [(a, b, t) for (a, b), t in zip(zip(bounds, bounds[1:]), seconds)]
        calibrated = _calibrated(costs, evidence)
    assert best is not None
    if best.balance > options.balance_goal and len(candidates) > 1:
        best = _remeasured(candidates, ref, options, int_bounds(model), say)
    say(f"verifying the {n}-stage cut against the original")
    best.verify_error = verify_stages(model, best.dir, best.manifest, lengths, options.atol,
                                      half.to if half is not None else FP32, options.serving)
    return best


@dataclass(frozen=True)
class HalfModel:
    """The model converted to a half precision, and its error against fp32 on the serving engine."""

    model: onnx.ModelProto
    to: Precision
    error: float  # the largest output error, over the fp32 output's largest magnitude


def _half_model(model: onnx.ModelProto, to: Precision, inputs: Sequence[TensorSpec], lengths: list[int],
                options: SliceOptions, say: Progress) -> HalfModel | None:
    """`model` in precision `to`, run on the engine that will serve and checked against the fp32
    model at the shortest and the longest length; None in fp32. Where the engine cannot run an op
    in that precision, a SliceError names it."""
    if not to.is_half:
        return None
    if external_data_dir(model) is not None:
        raise SliceError(f"{to.name}: converting a model over 2 GB (its weights on disk) is not supported; "
                         "convert it before slicing")
    engine = f"{options.serving.engine} on {options.serving.device}"
    say(f"converting to {to.name} and checking it against fp32 on {engine}")
    half = convert(model, to)
    rng = np.random.default_rng(3)
    full = full_session(model)
    error = 0.0
    for length in sorted(set(lengths[:1] + lengths[-1:])):
        feeds = random_inputs(inputs, 3, length, rng, int_bounds(model))
        expected = dict(zip([o.name for o in full.get_outputs()], full.run(None, feeds)))
        try:
            got = options.serving.run_once(half, feeds)
        except Exception as exc:
            hint = (" (the torch engine runs bf16 on the CPU: --engine torch)"
                    if to.name == "bf16" and options.serving.engine != "torch" else "")
            raise SliceError(f"the model cannot run in {to.name} on {engine}: {one_line(exc)}{hint}") from exc
        error = max(error, check_outputs(got, expected, to, f"the unsliced model at length {length}"))
    return HalfModel(half, to, error)


def _remeasured(candidates: list[Candidate], ref: Setting, options: SliceOptions, int_high: dict[str, int],
                say: Progress, top: int = 3) -> Candidate:
    """The best-balanced of the `top` candidates after timing each again, longer: one short timing
    on a busy machine can make a balanced cut look unbalanced, or the reverse. A stage's time is the
    lower of its two measurements (interference only ever adds time)."""
    say(f"timing the {min(top, len(candidates))} best cuts again")
    for cand in sorted(candidates, key=lambda c: c.balance)[:top]:
        again = _stage_seconds(cand.dir, cand.manifest, ref, options, int_high, 3 * options.repeats, min_seconds=0.3)
        cand.stage_seconds = [min(a, b) for a, b in zip(cand.stage_seconds, again)]
    return min(candidates, key=lambda c: c.balance)


def _stage_seconds(folder: Path, manifest: Manifest, ref: Setting, options: SliceOptions, int_high: dict[str, int],
                   repeats: int, min_seconds: float = 0.0) -> list[float]:
    """Each stage's time at the reference setting, on the engine and device that will serve."""
    if options.serving.is_default:
        return time_stages([folder / s.file for s in manifest.stages], [s.inputs for s in manifest.stages], ref,
                           options.threads, repeats, int_high, min_seconds=min_seconds)
    return options.serving.stage_seconds(folder, manifest, ref, int_high, repeats)


def _calibrated(costs: np.ndarray, evidence: list[tuple[int, int, float]]) -> np.ndarray:
    """Profiled node costs corrected by every stage measured so far.

    Each node's cost is scaled by the geometric mean of measured / estimated over the measured
    stages that contain it: rounds that cut differently refine each other, instead of the last
    measurement undoing the one before (profiles are taken without the fusions the engines do)."""
    log_ratio = np.zeros(len(costs))
    seen = np.zeros(len(costs))
    for a, b, seconds in evidence:
        estimate = float(costs[a:b].sum())
        if estimate > 0 and seconds > 0:
            log_ratio[a:b] += np.log(seconds / estimate)
            seen[a:b] += 1
    return costs * np.exp(log_ratio / np.maximum(seen, 1))


def _diversity_points(costs_at: dict[Setting, np.ndarray], settings: list[Setting], points: list[CutPoint]) -> set[int]:
    """Cut points where batching pays off on one side and not on the other."""
    small, large = settings[1], settings[2]
    per_query_small = costs_at[small] / small.batch
    per_query_large = costs_at[large] / large.batch
    window = max(1, len(per_query_small) // 8)
    found = set()
    for p in points:
        a, b = max(0, p.position - window), min(len(per_query_small), p.position + window)
        before = per_query_large[a:p.position].sum() / max(per_query_small[a:p.position].sum(), 1e-12)
        after = per_query_large[p.position:b].sum() / max(per_query_small[p.position:b].sum(), 1e-12)
        if (before < 0.8) != (after < 0.8):
            found.add(p.position)
    return found


def verify_stages(model: onnx.ModelProto, folder: Path, manifest: Manifest, lengths: list[int], atol: float,
                  to: Precision = FP32, serving: ServingEngine = ServingEngine()) -> float:
    """Run the stages in order and the original on the same random inputs; the max |difference|.
    Stages in a half precision run on the engine that will serve; their error is relative to the
    fp32 output's largest magnitude, within the precision's tolerance (slicer/precision.py)."""
    rng = np.random.default_rng(2)
    full = full_session(model)
    names = [o.name for o in full.get_outputs()]
    runs = []
    for length in sorted(set(lengths[:1] + lengths[-1:])):
        feeds = random_inputs(manifest.inputs, 3, length, rng, int_bounds(model))
        runs.append((length, feeds, dict(zip(names, full.run(None, feeds)))))
    del full  # the whole model and the stages are not held at once (a large model's weights twice)
    worst = 0.0
    for length, feeds, expected in runs:
        values = dict(feeds)
        for spec in manifest.stages:  # one stage's session at a time
            feeds = {t.name: values[t.name] for t in spec.inputs}
            if to.is_half:
                values = serving.run_once(folder / spec.file, feeds)
                continue
            session = ort.InferenceSession(str(folder / spec.file), providers=["CPUExecutionProvider"])
            outs = session.run([t.name for t in spec.outputs], feeds)
            values = dict(zip([t.name for t in spec.outputs], outs))
            del session
        if to.is_half:
            worst = max(worst, check_outputs(values, expected, to, f"the stages in a row at length {length}"))
            continue
        for name, ref in expected.items():
            diff = float(np.max(np.abs(values[name].astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
            tolerance = output_atol(ref.dtype, atol)
            if not diff <= tolerance:
                raise SliceError(f"verification failed: output {name!r} of the stages differs from the original "
                                 f"by {diff:.3g} (> {tolerance}) at length {length}")
            worst = max(worst, diff)
    return worst


# A candidate within this fraction of the fastest is as fast: the fewest stages among those wins. On
# a CPU with one buffer pair a pipeline overlaps only its own overhead, and one model's candidates'
# closed-loop throughput varies from round to round by nearly this much (and a lead when sliced need
# not hold when served): a stage must pay clearly for its hand-off and its memory.
STAGE_COUNT_TIE = 0.10
MEASURE_ROUNDS = 3  # each candidate's throughput: the median of this many rounds, the order alternating


def choose_stage_count(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate with the highest measured throughput, the fewest stages among those within
    `STAGE_COUNT_TIE` of it (each stage costs a hand-off and its memory; a tie buys nothing)."""
    best = max(c.throughput or 0.0 for c in candidates)
    return min((c for c in candidates if (c.throughput or 0.0) >= (1 - STAGE_COUNT_TIE) * best), key=lambda c: c.stages)


def measure_candidates(candidates: Sequence[Candidate], length: int, int_high: dict[str, int], concurrency: int,
                       say: Callable[[str], None], rounds: int = MEASURE_ROUNDS,
                       settings: RuntimeSettings | None = None) -> None:
    """Each candidate's served throughput (`measure_pipeline`), the median of `rounds` rounds with the
    candidates' order alternating, so a slow moment of the machine does not decide for one of them."""
    seen: dict[int, list[float]] = {c.stages: [] for c in candidates}
    for r in range(rounds):
        for cand in (candidates if r % 2 == 0 else list(reversed(candidates))):
            say(f"measuring the {cand.stages}-stage pipeline as it is served, round {r + 1} of {rounds}")
            seen[cand.stages].append(measure_pipeline(cand.dir, cand.manifest, length, int_high, seconds=0.4,
                                                      concurrency=concurrency, settings=settings))
    for cand in candidates:
        cand.throughput = float(np.median(seen[cand.stages]))


def choose_buffer_pairs(chosen: Candidate, length: int, int_high: dict[str, int], concurrency: int,
                        options: SliceOptions, say: Callable[[str], None], rounds: int = MEASURE_ROUNDS
                        ) -> dict[str, Any]:
    """Where the stages share one device: the buffer pairs (`PAIR_CANDIDATES`) with the highest
    closed-loop throughput as served, the fewest within `STAGE_COUNT_TIE` of it (a second pair lets
    stage 0 start a batch behind the others' work: it must pay for the smaller batches). The
    manifest's record (`slicing.buffer_pairs`, which the GPU config serves)."""
    seen: dict[int, list[float]] = {p: [] for p in PAIR_CANDIDATES}
    for r in range(rounds):
        for pairs in (PAIR_CANDIDATES if r % 2 == 0 else tuple(reversed(PAIR_CANDIDATES))):
            say(f"measuring {pairs} buffer pair(s) on {options.serving.device}, round {r + 1} of {rounds}")
            seen[pairs].append(measure_pipeline(chosen.dir, chosen.manifest, length, int_high, seconds=0.4,
                                                concurrency=concurrency, settings=_served(options, pairs)))
    measured = {p: float(np.median(v)) for p, v in seen.items()}
    best = max(measured.values())
    pick = min(p for p, q in measured.items() if q >= (1 - STAGE_COUNT_TIE) * best)
    return {"chosen": pick, "queries_per_second": {str(p): round(q, 1) for p, q in measured.items()},
            "why": f"the highest closed-loop throughput on {options.serving.device} ({concurrency} queries in flight, "
                   f"load policy), the fewest pairs within {STAGE_COUNT_TIE:.0%}: "
                   + ", ".join(f"{p} pair(s) {q:.0f}/s" for p, q in measured.items())}


def _served(options: SliceOptions, pairs: int = 1) -> RuntimeSettings:
    """The settings the candidates are measured with: as the slicer's config serves them (one
    buffer pair, each stage on every core) on the CPU; the serving engine's elsewhere."""
    if options.serving.is_default:
        return RuntimeSettings(num_buffer_pairs=pairs, threads_per_stage=available_cores(), fast_path=False)
    return options.serving.settings(options.max_batch_size, pairs)


def _write_config(model_dir: Path, manifest: Manifest, policy: str, serving: ServingEngine) -> None:
    """config.pbtxt and model.py: the CPU config (every core per stage), or on a GPU the GPU
    config with the buffer pairs measured there (slicer/gpu_config.py)."""
    extra = {} if serving.is_default else {"engine": serving.engine, "device": serving.device}
    write_triton_files(model_dir, manifest, policy=policy, extra=extra)
    if serving.device == "cuda":
        config = model_dir / "config.pbtxt"
        config.write_text(gpu_config(config.read_text(), 1, manifest.to_json()))


# A fresh pipeline's first batches are not its rate: the first run of each batch size allocates.
WARMUP_ROUNDS = 2  # unmeasured rounds of `concurrency` answers before the clock starts
MEASURED_ROUNDS = 4  # the timed window holds at least this many rounds of answers, and `seconds`


@contextlib.contextmanager
def _logger_quiet(name: str) -> Iterator[None]:
    """The named logger's warnings left out for the body's duration (errors still logged)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def measure_pipeline(folder: Path, manifest: Manifest, length: int, int_high: dict[str, int],
                     seconds: float = 0.6, concurrency: int = 8, settings: RuntimeSettings | None = None) -> float:
    """Queries per second through the runtime as the slicer's config serves it, closed loop at
    `concurrency` queries in flight: batches as the load policy makes them; by default on the
    local CPU, one buffer pair (stages one at a time), each stage on a pool of every core of its
    own, as served; else with `settings` (another engine or device, other pairs). Timed after
    `WARMUP_ROUNDS` rounds, over at least `MEASURED_ROUNDS` rounds and `seconds`."""
    from dvabatch_backend.runtime import load_pipeline
    from policies import create_policy

    # a candidate's stages are re-profiled at load on a GPU (its manifest holds this process's
    # first profile): on purpose in this measurement, so the re-profile's warning, meant for a
    # served model, is not logged
    with _logger_quiet("dvabatch_backend.runtime.device_times"):
        scheduler = load_pipeline(folder, create_policy("load"), settings or RuntimeSettings(
            num_buffer_pairs=1, threads_per_stage=available_cores(), fast_path=False))
    rng = np.random.default_rng(3)
    pool = [{k: v[0] for k, v in random_inputs(manifest.inputs, 1, length, rng, int_high).items()} for _ in range(16)]
    done = threading.Semaphore(0)
    sent = 0

    def next_answer() -> None:
        nonlocal sent
        if not done.acquire(timeout=10):
            raise SliceError(f"the pipeline in {folder} stopped answering while being measured")
        sent += 1
        scheduler.submit(pool[sent % len(pool)], lambda a: done.release())

    with scheduler:
        for i in range(concurrency):
            scheduler.submit(pool[i % len(pool)], lambda a: done.release())
        for _ in range(WARMUP_ROUNDS * concurrency):
            next_answer()
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < seconds or count < MEASURED_ROUNDS * concurrency:
            next_answer()
            count += 1
        elapsed = time.perf_counter() - start
    # a stopped pipeline is a cycle of threads' objects: collected now, its sessions' memory goes
    # before the next candidate loads (left to the collector, stopped candidates pile up in memory
    # and slow the one being measured)
    del scheduler
    gc.collect()
    return count / elapsed


def _policy_choice(profile: dict[str, Any]) -> dict[str, str]:
    """The policy the diversity report calls for (`policies.auto`), written in config.pbtxt and
    recorded in the manifest (where `policy: auto` finds it)."""
    from policies.auto import choose

    div = profile["diversity"]
    choice, why = choose(bool(div["input"]), bool(div["operator"]))
    return {"choice": choice, "why": why}


# a light load's queries come this far apart (200 a second): the fast path's engines are timed so
LIGHT_LOAD_GAP = 0.005
# the stages in a row serve the fast path only where they are this much faster than the unsliced
# model: served, one session spinning as onnxruntime's do answers a light load sooner than the
# stages in a row, each a session of its own, even where the two time alike in one process
FAST_PATH_MARGIN = 0.1


def fast_path_choice(folder: Path, manifest: Manifest, lengths: Sequence[int], threads: int,
                     int_high: dict[str, int]) -> dict[str, Any]:
    """Which engine runs a batch that meets nobody (`Scheduler.serve_whole_model`): the unsliced model
    (`model.onnx`, loaded beside the stages) or the stages in a row, each as served (the model's
    session spinning as onnxruntime's do by default, the stages' within a run:
    `loading.STAGE_SPINNING`), from one query at each profiled length `LIGHT_LOAD_GAP` after
    the last (`profiler.time_after_gaps`). {"engine": "model" | "stages", "why", "seconds"}."""
    model_file = folder / (manifest.full_model or "model.onnx")
    stage_files = [(folder / st.file, STAGE_SPINNING) for st in manifest.stages]
    specs = [[manifest.inputs], [st.inputs for st in manifest.stages]]
    seconds = {}
    for length in lengths:
        times = time_after_gaps([[(model_file, MODEL_SPINNING)], stage_files], specs, Setting(1, length), threads,
                                LIGHT_LOAD_GAP, int_high=int_high)
        seconds[str(length)] = {"model": times[0], "stages": times[1]}
    return fast_path_record(seconds, f"one query {LIGHT_LOAD_GAP * 1e3:g} ms after the last",
                            "one session's threads, spinning, keep a light load's next query quick")


def fast_path_record(seconds: dict[str, dict[str, float]], how: str, model_note: str = "") -> dict[str, Any]:
    """The fast path's engine from one query's times by length ({length: {"model", "stages"}}): the
    stages only where they are `FAST_PATH_MARGIN` faster than the unsliced model."""
    model, stages = (sum(t[k] for t in seconds.values()) for k in ("model", "stages"))
    engine = "stages" if stages < (1 - FAST_PATH_MARGIN) * model else "model"
    why = (f"{how}: the unsliced model {model * 1e3:.2f} ms, the stages in a row {stages * 1e3:.2f} ms "
           f"(summed over lengths {[int(n) for n in seconds]}): "
           + (f"the unsliced model, loaded beside the stages (the stages are not {FAST_PATH_MARGIN:.0%} faster"
              + (f"; {model_note})" if model_note else ")") if engine == "model"
              else f"the stages (faster by over {FAST_PATH_MARGIN:.0%}: no second copy of the weights)"))
    return {"engine": engine, "why": why, "seconds": seconds}


def _measured_on(serving: ServingEngine) -> str:
    """How the stage-count candidates were served while measured (`_served`), for the record."""
    return ("every core" if serving.is_default
            else f"{serving.engine} on {serving.device}")


def _stage_count_record(candidates: Sequence[Candidate], chosen: Candidate, has_seq: bool,
                        asked: int | None, measured_on: str) -> dict[str, Any]:
    """The manifest's record of how many stages and why; `measured_on`: how the candidates ran."""
    if asked is not None:
        return {"chosen": chosen.stages, "why": "asked for (--stages)"}
    if len(candidates) == 1:
        return {"chosen": chosen.stages, "why": "the only candidate the model's cut points and length axis allow"}
    measured = {str(c.stages): round(c.throughput or 0.0, 1) for c in candidates}
    why = (f"the highest closed-loop throughput as served (load policy, one buffer pair, {measured_on}), the fewest "
           f"stages within {STAGE_COUNT_TIE:.0%}: " + ", ".join(f"{n} stage(s) {q:g}/s" for n, q in measured.items()))
    if has_seq:
        why += "; 1 stage not tried: a variable-length model's stages let short queries exit early"
    return {"chosen": chosen.stages, "queries_per_second": measured, "why": why}


def _final_manifest(chosen: Candidate, profile: dict[str, Any], ref: Setting, options: SliceOptions,
                    pad: PadSafety, input_bounds: dict[str, int], policy: dict[str, str],
                    fast_path: dict[str, Any] | None = None, stage_count: dict[str, Any] | None = None,
                    rule: LengthRule = LengthRule(), device: str = "cpu",
                    buffer_pairs: dict[str, Any] | None = None, half: HalfModel | None = None) -> Manifest:
    doc = chosen.manifest.to_json()
    doc["length_multiple"], doc["min_length"], doc["length_rule"] = rule.multiple, rule.min_length, rule.why
    doc["policy"] = policy
    if fast_path is not None:
        doc["fast_path"] = fast_path
    doc["pad_safe"] = pad.safe
    doc["input_bounds"] = {k: v for k, v in input_bounds.items() if k in {t.name for t in chosen.manifest.inputs}}
    doc["stage_times"] = stage_times_at(profile, ref.length)
    if chosen.manifest.has_seq:
        doc["stage_times_by_length"] = {str(n): stage_times_at(profile, n) for n in profile["lengths"]}
    doc["slicing"] = {
        "reference": {"batch": ref.batch, "length": ref.length},
        "stage_seconds": chosen.stage_seconds,
        "balance": chosen.balance,
        "cuts": [{"position": c.position, "tensors": list(c.tensors)} for c in chosen.partition.cuts],
        "verify_max_error": chosen.verify_error,
        "threads": options.threads,
        "pad_check": pad.detail,
    }
    if stage_count is not None:
        doc["slicing"]["stage_count"] = stage_count
    if not options.serving.is_default:
        doc["slicing"]["engine"] = {"engine": options.serving.engine, "device": options.serving.device}
    if device != "cpu":  # where the stage times were measured (runtime/device_times.py)
        doc["profiled_on"] = device
    if buffer_pairs is not None:
        doc["slicing"]["buffer_pairs"] = buffer_pairs
    if half is not None:  # the errors against the fp32 model, over each output's largest magnitude
        doc["slicing"]["precision"] = {"precision": half.to.name, "tolerance": half.to.tolerance,
                                       "model_error": half.error, "stages_error": chosen.verify_error}
    manifest = Manifest.from_json(doc)
    manifest.dump(chosen.dir / "manifest.json")
    return manifest


def _write_profile(folder: Path, manifest: Manifest, profile: dict[str, Any]) -> None:
    (folder / "profile.json").write_text(json.dumps(profile, indent=2) + "\n")
