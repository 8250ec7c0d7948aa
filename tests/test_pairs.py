"""The walk of the compatibility table (:mod:`jaxpar.compat._table`): every pair of features has an answer.

* :func:`test_every_pair_has_an_answer`: each pair of :func:`jaxpar.compat.all_pairs` is refused,
  or composes and :data:`COMPOSES_TESTS` names the tests that compare it with its reference
  (single-device for synchronous features, the sequential reference for PipeDream-2BW and weight
  stashing; for lossy codecs the lossless codec's run of the pair plus the codec's own tests).
* :func:`test_refusals_name_both_features`: for every refused pair (and the refused values of the
  partly-composing ones), a setting with both features on gets a :class:`~jaxpar.compat.Problem`
  of that pair whose message names both fields; :func:`test_each_problem_is_a_refused_pair_that_is_on`:
  no rule names a pair the table says composes, or a feature that is off.
* :func:`test_pair_matches_its_reference`: one harness for the composing pairs that had no test:
  the pair's two features on, on the 8 simulated devices, against a one-device reference computed
  here step by step (:func:`reference`): plain, delayed (2BW: the gradient at ``W(t-1)``) or per
  stage (weight stashing). The features: ZeRO-3 (Z), tensor 2 (TP), sequence parallelism (SP),
  2 micro-batches (MB), bf16 compute (BF), full remat (RM), ``explicit_dp=True`` (EX), 1F1B pipe 2
  (PP), PipeDream-2BW (2B), weight stashing (ST), ``steps_per_call=2`` (K), the lossless top-k
  codec ``topk(1.0)`` (CP), ``local_clip`` (LC), synchronous replicas (RS: the reference is data
  parallelism), ``clip_norm`` (CN), ``skip_nonfinite`` with a NaN step (SN), the noise scale every
  2 steps (NS: its measured norms against the replicas' gradients materialised here), a fixed batch
  ramp through :func:`jaxpar.run.train` (BR), per-layer LARS (LL), Muon routed by logical names (MU:
  its matrices compared as LARS's, by their movement; its AdamW half as AdamW), 1-bit Adam's moment
  exchange with the lossless top-k (1A: ``adamw_frozen_variance``), a checkpoint restored mid-run
  (CK: the resumed run equals the uninterrupted one bit for bit), two processes (MP: the same
  run on one process), the MoE GPT over an expert axis of 2 (EP) and aux-loss-free balancing
  (RB: the MoE GPT at capacity 1.0 without the aux loss, ``with_router_bias`` at :data:`RB_RATE`;
  the reference moves the bias after every step by the sign rule on that step's loads, and the
  run's bias must equal it exactly), memory offloading (OF: the optimizer state and the master weights in
  host memory, and each layer's input offloaded under the remat policy ``"offload"`` where the pair sets
  no remat of its own). One case per feature runs in the default pass, the rest in the
  exhaustive tier.
  A partly-composing pair runs its composing value (Z x 1A: ZeRO-1).
* the cases asked for by name: the noise scale with every flush schedule and with a codec, bf16
  with every schedule, sequence parallelism with accumulation and ZeRO.

The test GPT is smaller than tests/helpers.py's (compiles ~30% faster): vocab 32, 8 tokens, embed
16, 2 heads, 2 layers (4 for the interleaved schedule). AdamW (lr 1e-3, weight decay 0.1) unless
the pair says otherwise. Tolerances, fp32 (tests/helpers.py): losses rtol 1e-5, first-step
gradients rtol 1e-4 + 1e-5 x the leaf's largest, parameters after Adam rtol 1e-4 / atol 1e-6 +
``helpers.adam_atol``. bf16: see :data:`BF16_LOSS_RTOL`.

Run as a script, this file is one process of the two-process runs (MP): see :func:`_mp_main`.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxpar
from jaxpar.compat import _table as compat
from jaxpar.compat import LIBRARY_NAMES, Setting, pair_status, problems

ROOT = Path(__file__).resolve().parents[1]


# =============================================================================== 1. the table
# Pairs that compose, with the tests that compare them with their reference. Existing tests are
# the composition audit's C-notes (/work/shared/reviews/composition_audit_086e695.md, section 4);
# the rest are in this file. A pair may list tests of both kinds.
_EQ = "tests/test_equivalence.py::test_strategy_matches_single_device"
_BF16 = "tests/test_models.py::test_bf16_compute_keeps_fp32_master_weights"
_REMAT = "tests/test_models.py::test_remat_policies_do_not_change_numbers"
_EXPLICIT = "tests/test_equivalence.py::test_explicit_data_parallel_matches"
_PIPE = "tests/test_pipeline.py::test_composed_pipeline_trains_like_single_device"
_BYO_PIPE = "tests/test_byo_model.py::test_user_model_pipelined_matches_single_device"
_2BW_SHARDED = "tests/test_async_pipeline.py::test_2bw_with_zero3_fsdp_and_tensor_equals_delayed_gradient_reference"
_STASH_SHARDED = "tests/test_weight_stashing.py::test_stashing_with_sharded_weights_equals_per_stage_reference"
_CKPT_STASH = "tests/test_weight_stashing.py::test_checkpoint_of_another_schedule_restores_into_stashing_and_back"
_CODEC_RESET = "tests/test_compression_step.py::test_restore_onto_other_replicas_resets_the_codec_state_with_a_warning"
_CODECS = ["tests/test_compression_step.py::test_codecs_train_under_the_strategies",
           "tests/test_compression_step.py::test_codec_strategy_matrix"]
_LOSSLESS = "tests/test_compression_step.py::test_lossless_settings_match_the_uncompressed_step"
_LOCAL_CLIP = ["tests/test_compression_step.py::test_local_clip_trains_under_zero3_and_pipelines",
               "tests/test_compression_step.py::test_local_clip_clips_each_replica_before_the_codec"]
_CLI_CLIP = ["tests/test_multiprocess.py::test_two_processes_match_one_process[zero3_tp]",
             "tests/test_compression_train.py::test_exact_resume_after_sigkill_with_stateful_codecs",
             "tests/test_cli.py::test_byo_model_config_trains",
             "tests/test_relaxed_sync.py::test_relaxed_training_converges"]
_SKIP = "tests/test_checkpoint.py::test_nonfinite_step_is_skipped_and_reported"
_ONEBIT = ["tests/test_onebit_adam.py::test_onebit_adam_trains_under_zero1_and_pipelines",
           "tests/test_onebit_adam.py::test_before_start_step_it_is_adamw_with_the_exact_exchange",
           "tests/test_onebit_adam.py::test_adam_first_moment_is_the_exchanged_compressed_moment"]
_RESTORE = ["tests/test_checkpoint.py::test_restore_onto_other_meshes_and_strategies",
            "tests/test_pipeline.py::test_pipelined_checkpoint_restores_onto_other_meshes"]
_MP = "tests/test_multiprocess.py::test_two_processes_match_one_process"
_HERE = "tests/test_pairs.py::test_pair_matches_its_reference"

EXISTING: dict[tuple[str, str], list[str]] = {
    # C1, C30
    ("Z", "TP"): [_EQ], ("Z", "SP"): [_EQ], ("Z", "MB"): [_EQ], ("TP", "SP"): [_EQ], ("TP", "MB"): [_EQ],
    ("SP", "MB"): [f"{_EQ}[dp2-zero2-fsdp2-tp2-sp-accum2]"],
    # C2
    ("Z", "BF"): [_BF16], ("TP", "BF"): [_BF16, "tests/test_byo_model.py::test_user_model_bf16_compute_trains"],
    ("BF", "EX"): [f"{_BF16}[fsdp8-explicit]"],
    # C3, C6
    ("Z", "RM"): [_REMAT], ("TP", "RM"): [_REMAT], ("RM", "EX"): [_REMAT],
    ("RM", "PP"): ["tests/test_pipeline.py::test_remat_policies_inside_the_pipeline"],
    # C4
    ("Z", "EX"): [_EXPLICIT], ("TP", "EX"): [_EXPLICIT],
    ("MB", "EX"): ["tests/test_byo_model.py::test_user_model_matches_single_device[zero3-accum2]"],
    # C5, C7, C8
    ("Z", "PP"): [_PIPE, _BYO_PIPE], ("TP", "PP"): [_PIPE],
    ("Z", "2B"): [_2BW_SHARDED], ("TP", "2B"): [_2BW_SHARDED],
    ("Z", "ST"): [_STASH_SHARDED], ("TP", "ST"): [_STASH_SHARDED],
    # C9: the codecs train under the strategies; the lossless codec's run is the reference run
    ("Z", "CP"): [*_CODECS, _LOSSLESS], ("TP", "CP"): [*_CODECS, f"{_HERE}[TP-CP]"],
    ("MB", "CP"): [*_CODECS, f"{_HERE}[MB-CP]"], ("PP", "CP"): [*_CODECS, f"{_HERE}[PP-CP]"],
    # C10
    ("Z", "LC"): [*_LOCAL_CLIP, f"{_HERE}[Z-LC]"], ("TP", "LC"): [*_LOCAL_CLIP, f"{_HERE}[TP-LC]"],
    ("PP", "LC"): [*_LOCAL_CLIP, f"{_HERE}[PP-LC]"], ("CP", "LC"): _LOCAL_CLIP,
    # C11
    ("Z", "RS"): ["tests/test_relaxed_sync.py::test_diloco_composes_with_inner_strategies"],
    ("TP", "RS"): ["tests/test_relaxed_sync.py::test_diloco_composes_with_inner_strategies"],
    # C12: CLI runs with clip_norm (the quickstart recipe); compared with a reference here
    ("Z", "CN"): [*_CLI_CLIP, f"{_HERE}[Z-CN]"], ("TP", "CN"): [*_CLI_CLIP, f"{_HERE}[TP-CN]"],
    ("PP", "CN"): [*_CLI_CLIP, f"{_HERE}[PP-CN]"], ("CP", "CN"): [*_CLI_CLIP, f"{_HERE}[CP-CN]"],
    ("RS", "CN"): [*_CLI_CLIP, f"{_HERE}[RS-CN]"], ("CN", "MP"): [f"{_MP}[zero3_tp]"],
    # C13
    ("Z", "SN"): [_SKIP], ("TP", "SN"): [_SKIP],
    ("CP", "SN"): ["tests/test_checkpoint.py::test_nonfinite_step_with_compression_prints_its_nan_residual"],
    ("SN", "CK"): [_SKIP],
    # C14
    ("Z", "NS"): ["tests/test_noise_scale.py::test_measured_norms_equal_materialised_per_replica_gradients[zero2]"],
    # C15
    ("Z", "LL"): ["tests/test_large_batch_optim.py::test_strategy_matches_single_device"],
    ("TP", "LL"): ["tests/test_large_batch_optim.py::test_strategy_matches_single_device"],
    # C16, C29
    ("Z", "1A"): [*_ONEBIT, f"{_HERE}[Z-1A]"], ("PP", "1A"): [*_ONEBIT, f"{_HERE}[PP-1A]"],
    ("LC", "1A"): [*_ONEBIT, f"{_HERE}[LC-1A]"], ("CP", "1A"): _ONEBIT,
    # C17, C21-C28, C31
    ("Z", "CK"): _RESTORE, ("TP", "CK"): _RESTORE, ("PP", "CK"): _RESTORE,
    ("2B", "CK"): ["tests/test_async_pipeline.py::test_2bw_resumes_bit_exact",
                   "tests/test_async_pipeline.py::test_checkpoint_of_another_schedule_resumes_2bw_with_equal_versions"],
    ("K", "CK"): ["tests/test_async_pipeline.py::test_train_loop_runs_k_steps_per_call_and_resumes"],
    ("ST", "CK"): ["tests/test_weight_stashing.py::test_stashing_resumes_bit_exact",
                   _CKPT_STASH],
    ("CP", "CK"): ["tests/test_compression_step.py::test_codec_state_is_checkpointed_bit_exactly",
                   _CODEC_RESET],
    ("RS", "CK"): ["tests/test_relaxed_sync.py::test_resume_mid_run_is_bit_exact",
                   "tests/test_relaxed_sync.py::test_diloco_checkpoint_restores_onto_another_inner_strategy"],
    ("NS", "CK"): ["tests/test_noise_scale.py::test_moving_averages_survive_a_checkpoint_bit_exactly_and_are_logged"],
    ("BR", "CK"): ["tests/test_batch_ramp.py::test_resume_mid_ramp_after_sigkill_is_bit_identical"],
    ("NS", "BR"): ["tests/test_batch_ramp.py::test_adaptive_ramp_follows_the_noise_scale_and_resumes_bit_exact"],
    ("1A", "CK"): ["tests/test_compression_step.py::test_codec_state_is_checkpointed_bit_exactly[sign-1bit-adam]"],
    ("CK", "MP"): ["tests/test_multiprocess.py::test_sigterm_to_one_process_stops_all_at_the_same_step"],
    ("Z", "MP"): [f"{_MP}[zero3_tp]"], ("TP", "MP"): [f"{_MP}[zero3_tp]"],
    # C19, C20
    ("2B", "K"): ["tests/test_async_pipeline.py::test_no_flush_program_equals_delayed_gradient_reference"],
    ("ST", "K"): ["tests/test_weight_stashing.py::test_stashing_equals_per_stage_reference",
                  f"{_STASH_SHARDED}[fsdp2-data2-sgd-K2]"],
    ("Z", "K"): [f"{_STASH_SHARDED}[fsdp2-data2-sgd-K2]"],
}

#: Composing pairs whose existing test is not a comparison with a reference (C9, C10, C12, C16:
#: "trains", a CLI run): the harness compares them too.
WEAK = [p for p, tests in EXISTING.items() if any(t.startswith(_HERE) for t in tests)]

# The pairs with a test of their own in this file (section 4); the rest of the new pairs run
# through the harness (section 3).
_NS_PIPE = "tests/test_pairs.py::test_noise_scale_with_a_flush_pipeline"
_NS_CODEC = "tests/test_pairs.py::test_noise_scale_with_a_codec"
_BF_SCHED = "tests/test_pairs.py::test_bf16_under_every_schedule"
_MP_HERE = "tests/test_pairs.py::test_pair_on_two_processes"
DEDICATED: dict[tuple[str, str], list[str]] = {
    ("PP", "NS"): [_NS_PIPE], ("CP", "NS"): [_NS_CODEC],
    ("BF", "PP"): [f"{_BF_SCHED}[1f1b]", f"{_BF_SCHED}[gpipe]", f"{_BF_SCHED}[interleaved]", f"{_BF_SCHED}[zb-h1]"],
    ("BF", "2B"): [f"{_BF_SCHED}[pipedream-2bw]"], ("BF", "ST"): [f"{_BF_SCHED}[pipedream]"],
    ("SP", "MB"): ["tests/test_pairs.py::test_sequence_parallel_with_accumulation_and_zero"],
    ("Z", "SP"): ["tests/test_pairs.py::test_sequence_parallel_with_accumulation_and_zero"],
}
#: Several processes (MP): one two-process job runs all these pairs (section 5).
MP_PAIRS = [("SP", "MP"), ("MB", "MP"), ("BF", "MP"), ("RM", "MP"), ("EX", "MP"), ("PP", "MP"), ("2B", "MP"),
            ("ST", "MP"), ("K", "MP"), ("CP", "MP"), ("LC", "MP"), ("RS", "MP"), ("SN", "MP"), ("NS", "MP"),
            ("BR", "MP"), ("LL", "MP"), ("1A", "MP"), ("CX", "MP"), ("EP", "MP"), ("RB", "MP"), ("MP", "F8"), ("MP", "MU"),
            ("MP", "OF")]


def _key(a: str, b: str) -> tuple[str, str]:
    """The pair in the table's order."""
    return (a, b) if compat.CODES.index(a) < compat.CODES.index(b) else (b, a)


def _composing() -> list[tuple[str, str]]:
    return [p for p in compat.all_pairs() if pair_status(*p) in ("composes", "partly")]


def _new_pairs() -> list[tuple[str, str]]:
    """Composing pairs without an existing test, in the table's order."""
    return [p for p in _composing() if p not in EXISTING]


def _harness_pairs() -> list[tuple[str, str]]:
    mp = {_key(*p) for p in MP_PAIRS}
    return [p for p in _composing() if (p not in EXISTING or p in WEAK) and p not in DEDICATED and p not in mp]


def composes_tests() -> dict[tuple[str, str], list[str]]:
    """:data:`COMPOSES_TESTS`, built from the lists above."""
    out = {p: list(t) for p, t in EXISTING.items()}
    for p, tests in DEDICATED.items():
        out.setdefault(p, []).extend(tests)
    for p in _harness_pairs():
        out.setdefault(p, []).append(f"{_HERE}[{p[0]}-{p[1]}]")
    for a, b in MP_PAIRS:
        out.setdefault(_key(a, b), []).append(f"{_MP_HERE}[{a}-{b}]")
    return {k: sorted(set(v), key=v.index) for k, v in out.items()}


COMPOSES_TESTS: dict[tuple[str, str], list[str]] = composes_tests()


@functools.lru_cache(maxsize=None)
def _test_functions(path: str) -> frozenset:
    """The names of the test functions (module level or in classes) of ``path``."""
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def test_every_pair_has_an_answer():
    """Every pair of the table is refused (a named error) or composes and is compared
    with its reference by a test that exists. ``partly``: both (the refused values are in
    :func:`test_refusals_name_both_features`); ``alternatives``: never both on."""
    statuses = {}
    for a, b in compat.all_pairs():
        statuses[(a, b)] = pair_status(a, b)
    unknown = {p: s for p, s in statuses.items() if s not in ("refused", "composes", "partly", "alternatives")}
    assert not unknown, unknown
    untested = [p for p, s in statuses.items() if s in ("composes", "partly") and not COMPOSES_TESTS.get(p)]
    assert not untested, f"composing pairs without a test in COMPOSES_TESTS: {untested}"
    stale = [p for p in COMPOSES_TESTS if statuses.get(p) not in ("composes", "partly")]
    assert not stale, f"COMPOSES_TESTS lists pairs that do not compose: {[(p, statuses.get(p)) for p in stale]}"
    missing = []
    for pair, tests in COMPOSES_TESTS.items():
        for node in tests:
            path, _, name = node.partition("::")
            name = name.split("[")[0]
            if not (ROOT / path).is_file() or name not in _test_functions(path):
                missing.append((pair, node))
    assert not missing, f"tests named in COMPOSES_TESTS that do not exist: {missing}"
    here = [p for p in _new_pairs() if not any(t.startswith("tests/test_pairs.py::") for t in COMPOSES_TESTS[p])]
    assert not here, f"pairs without an existing test and without one here: {here}"
    # alternatives: no setting turns both on (one schedule at a time; micro-batches are the pipeline's)
    for a, b in (p for p, s in statuses.items() if s == "alternatives"):
        assert not _both_on(_setting_for((a, b)), a, b), (a, b)


# ====================================================================== 2. the refused pairs
def _feature(code: str) -> compat.Feature:
    return compat.FEATURES[compat.CODES.index(code)]


#: The fields of :class:`~jaxpar.compat.Setting` each feature is asked with (a message about the
#: pair names one of each feature's fields).
FIELDS = {"Z": ("zero",), "TP": ("tensor",), "SP": ("sequence_parallel",), "MB": ("microbatches",),
          "BF": ("compute_dtype",), "EX": ("explicit_dp",), "PP": ("schedule", "pipe"),
          "2B": ("schedule", "pipe"), "ST": ("schedule", "pipe"), "K": ("steps_per_call",),
          "CP": ("compression",), "LC": ("local_clip",), "RS": ("sync", "replica"), "CN": ("clip_norm",),
          "NS": ("noise_scale_every",), "BR": ("ramp", "ramp_steps"), "1A": ("compression",),
          "LL": ("optimizer",), "CX": ("context",), "EP": ("expert",), "RB": ("router_bias_rate",),
          "F8": ("fp8",), "MU": ("optimizer",), "OF": ("offload",)}
#: The router bias's rate (RB: ``with_router_bias(..., rate=)``), in the settings and the runs.
RB_RATE = 0.05
#: Features a Setting cannot express (they are a model, an optimizer, a loop or a launcher choice).
UNSETTABLE = {"RM", "SN", "LL", "CK", "MP"}
#: Of those, the features whose refused value a Setting says (LL: an optimizer across stages).
REFUSED_VALUE_SETTABLE = {"LL"}


def _setting_for(pair, *, ramp: str = "fixed") -> Setting:
    """The smallest :class:`Setting` with both features of ``pair`` on (where a Setting can say so)."""
    from jaxpar.parallel.compression import topk
    from jaxpar.parallel.sync import synchronous

    codes = set(pair)
    st: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    kw: dict[str, Any] = {}
    for c in sorted(codes, key=compat.CODES.index):
        if c == "Z":
            st["zero"] = 3
            sizes["data"] = 2
        elif c in ("TP", "SP"):
            sizes["tensor"] = 2
            st["sequence_parallel"] = st.get("sequence_parallel", False) or c == "SP"
        elif c == "MB":
            st["microbatches"] = 2
        elif c == "BF":
            st["compute_dtype"] = "bfloat16"
        elif c == "EX":
            kw["explicit_dp"] = True
            sizes["data"] = 2
        elif c in ("PP", "2B", "ST"):
            sizes["pipe"] = 2
            st["microbatches"] = 2
            st["schedule"] = {"PP": "1f1b", "2B": "pipedream-2bw", "ST": "pipedream"}[c]
        elif c == "K":
            kw["steps_per_call"] = 2
        elif c in ("CP", "LC", "1A"):
            sizes["data"] = 2
            if c == "1A":
                st["compression"] = topk(0.01, optimizer_momentum=0.9, start_step=1)
            else:
                st.setdefault("compression", topk(0.01))
            if c == "LC":
                st["local_clip"] = 1.0
        elif c == "RS":
            sizes["replica"] = 2
        elif c == "CN":
            kw["clip_norm"] = 1.0
        elif c == "NS":
            kw["noise_scale_every"] = 1
            sizes["data"] = 2
        elif c == "BR":
            kw["ramp"] = ramp
            kw["ramp_steps"] = (0, 3) if ramp == "fixed" else ()
        elif c == "LL":
            kw["optimizer_across_stages"] = True
        elif c == "CX":
            sizes["context"] = 2
        elif c == "EP":
            sizes["expert"] = 2
        elif c == "RB":
            kw["router_bias_rate"] = RB_RATE
        elif c == "F8":
            st["fp8"] = jaxpar.parallel.Fp8()
        elif c == "OF":
            st["offload"] = jaxpar.parallel.Offload(optimizer=True, master=True)
        elif c == "MU" and not codes & {"LL", "1A"}:     # one optimizer at a time (the alternatives)
            kw["muon"] = (("blocks/w1", ()),)
    if "replica" in sizes and "compression" not in st:
        st["sync"] = synchronous()             # a Strategy refuses sync with a codec: the replica axis says it
    return Setting(jaxpar.Strategy(**st), sizes, **kw)


def _both_on(setting: Setting, a: str, b: str) -> bool:
    return all(_feature(c).on(setting) for c in (a, b))


def _refused_pairs() -> list[tuple[str, str]]:
    return [p for p in compat.all_pairs() if pair_status(*p) in ("refused", "partly")]


#: The refused value of the partly-composing pairs.
PARTLY_REFUSED = {("Z", "1A"): "ZeRO-2", ("ST", "LL"): "clip_by_global_norm / a global-norm optimizer",
                  ("EX", "F8"): "rowwise FP8", ("PP", "OF"): "offloaded activations",
                  ("2B", "OF"): "offloaded activations", ("ST", "OF"): "offloaded activations",
                  ("BR", "K"): "a ramp step inside a call", ("ST", "MU"): "Muon matrices split inside a stage"}


def _refusal_params():
    return [pytest.param(pair, id=f"{pair[0]}-{pair[1]}") for pair in _refused_pairs()]


@pytest.mark.parametrize("pair", _refusal_params())
def test_refusals_name_both_features(pair):
    """A setting with both features on gets a Problem of this very pair, whose message names a
    field of each feature (with the library's names)."""
    a, b = pair
    unsettable = {a, b} & UNSETTABLE - REFUSED_VALUE_SETTABLE
    assert not unsettable, f"{pair}: a Setting cannot turn {sorted(unsettable)} on"
    setting = _refused_setting(pair)
    assert _both_on(setting, a, b), (pair, setting)
    found = problems(setting)
    mine = [p for p in found if set(p.features) == {a, b}]
    assert mine, f"{pair}: problems() gives {[p.features for p in found]}"
    for p in mine:
        text = p.render(LIBRARY_NAMES)
        for code in (a, b):
            names = [LIBRARY_NAMES.get(f, f) for f in FIELDS[code]]
            assert any(n in text for n in names), f"{pair}: the message names none of {names}: {text}"
        assert "{" not in text and "}" not in text, text       # every placeholder filled


def _refused_setting(pair, *, ramp: str = "fixed") -> Setting:
    """:func:`_setting_for` with the refused value of a partly-composing pair (Z x 1A: ZeRO-2; EX x F8: rowwise)."""
    setting = _setting_for(pair, ramp=ramp)
    if pair == ("Z", "1A"):
        setting = setting._replace(strategy=dataclasses.replace(setting.strategy, zero=2))
    if pair in (("PP", "OF"), ("2B", "OF"), ("ST", "OF")):
        names = ("jaxpar_layer_input",)
        offload = dataclasses.replace(setting.strategy.offload, activations=names)
        setting = setting._replace(strategy=dataclasses.replace(setting.strategy, offload=offload))
    if pair == ("EX", "F8"):
        setting = setting._replace(strategy=dataclasses.replace(setting.strategy, fp8=jaxpar.parallel.Fp8("rowwise")))
    if pair == ("ST", "MU"):
        setting = setting._replace(sizes={**setting.sizes, "tensor": 2}, muon=(("blocks/w1", ("tensor",)),))
    if ramp == "adaptive":
        setting = setting._replace(noise_scale_every=None)
    return setting


def _raising_params():
    return _refusal_params() + [pytest.param(("BR", "K"), "adaptive", id="BR-K-adaptive")]


@pytest.mark.parametrize("pair,ramp", [(p.values[0], "fixed") if len(p.values) == 1 else p.values
                                       for p in _raising_params()],
                         ids=[p.id for p in _raising_params()])
def test_refusals_raise_their_declared_class(pair, ramp):
    """Every problem of a refused pair (and of the refused values of a partly-composing one) declares
    a :class:`~jaxpar.errors.JaxparError` subclass, and :func:`~jaxpar.compat.raise_problems`
    raises the setting's first problem as exactly that class, with the library's message. The first
    problem is the pair's own, or, for a part of a codec (LC, 1A: ``compat.IMPLIES``), the same
    refusal of the whole codec (CP), whose class the part's copy keeps."""
    setting = _refused_setting(pair, ramp=ramp)
    found = problems(setting)
    mine = [p for p in found if set(p.features) == set(pair)]
    assert mine, f"{pair}: problems() gives {[p.features for p in found]}"
    for p in mine:
        assert issubclass(p.error, jaxpar.JaxparError) and p.error is not jaxpar.JaxparError, (pair, p.error)
    with pytest.raises(jaxpar.JaxparError) as err:
        compat.raise_problems(setting)
    assert type(err.value) is found[0].error, (pair, type(err.value), found[0].error)
    assert str(err.value) == found[0].render(LIBRARY_NAMES)
    if set(found[0].features) != set(pair):
        wholes = {compat.IMPLIES[c][0] if c in compat.IMPLIES else c for c in pair}
        assert set(found[0].features) == wholes, (pair, found[0].features)
    assert type(err.value) is mine[0].error, (pair, type(err.value), mine[0].error)


# Every Problem that a setting gets is a refused (or partly refused) pair, both of whose features
# are on: otherwise the table and the rules disagree.
def _probe_settings():
    out = [(f"{a}-{b}", _setting_for((a, b))) for a, b in _refused_pairs()
           if not {a, b} & UNSETTABLE - REFUSED_VALUE_SETTABLE]
    out += [("BR-K-fixed-inside-a-call", _setting_for(("BR", "K"))),
            ("BR-K-adaptive", _setting_for(("BR", "K"), ramp="adaptive")._replace(noise_scale_every=None)),
            ("K-pipe1", Setting(jaxpar.Strategy(), {"data": 8}, steps_per_call=2)),
            ("2B-CP-pipe1", Setting(jaxpar.Strategy(schedule="pipedream-2bw", microbatches=2,
                                                    compression=_topk()), {"data": 8}))]
    return out


def _topk():
    from jaxpar.parallel.compression import topk

    return topk(0.01)


def _probe_params():
    return [pytest.param(setting, id=name) for name, setting in _probe_settings()]


@pytest.mark.parametrize("setting", _probe_params())
def test_each_problem_is_a_refused_pair_that_is_on(setting):
    for p in problems(setting):
        assert pair_status(*p.features) in ("refused", "partly"), (p.features, pair_status(*p.features))
        assert _both_on(setting, *p.features), f"{p.features}: not both on in {setting}"


# ========================================================== 3. the harness for composing pairs
from jaxpar.models import GPTConfig, MoESettings  # noqa: E402

PCFG = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2)
#: RB: aux-loss-free balancing alone (no aux loss) at rate :data:`RB_RATE` (the router's softmax scores
#: are ~1/4), 4 experts, top 2, capacity 1.0 (C = 4 of a row's 8 tokens x 2 choices: assignments are
#: dropped), so the bias changes which experts the tokens go to and which of them are dropped.
RB_MOE = MoESettings(experts=4, top_k=2, capacity_factor=1.0, aux_weight=0.0, z_weight=1e-3, bias_rate=RB_RATE)
ROWS = 16
LR = 1e-3
MUON_LR = 0.02     # Muon's (MU), its AdamW half at LR
CLIP = 0.15         # clip_norm: the first gradient's norm is 0.62 (0.22 after local clips), so it clips
LOCAL_CLIP = 0.6    # local_clip: each replica's first gradient has norm >= 0.83 (2 replicas) .. 1.5 (8)
N_DEVICES = 8
#: 1-bit Adam's optimizer here: ``adamw_frozen_variance(lr, freeze_step=1, eps=1e-3)``. With Adam's
#: eps 1e-8, freezing the variance after one step lets an element whose first gradient was ~0 take
#: steps of lr m / 1e-8 (the GPT's w1 moved by 27 in 3 steps): round-off then decides the run, and
#: no comparison is possible. eps 1e-3 (above most gradients here) bounds the step by ~|m|.
FROZEN_EPS = 1e-3


@dataclasses.dataclass
class Spec:
    """A run: the mesh, the strategy, the step's and the loop's options, what to compare."""

    codes: tuple
    sizes: dict = dataclasses.field(default_factory=dict)
    strategy: dict = dataclasses.field(default_factory=dict)
    step_kw: dict = dataclasses.field(default_factory=dict)
    ns_every: int | None = None   # measure the noise scale every that many steps (with_noise_scale(every=))
    tx: str = "adamw"             # adamw | lars | frozen (1-bit Adam's adamw_frozen_variance) | muon
    cfg: Any = PCFG
    remat: str = "none"
    steps: int = 3
    rows: tuple = (ROWS,) * 3
    nan_step: int | None = None
    ckpt: bool = False
    ramp: bool = False

    @property
    def bias_rate(self) -> float | None:
        """The router bias's rate (RB: ``with_router_bias``), ``None`` without it."""
        return getattr(self.cfg.moe, "bias_rate", 0.0) or None

    @property
    def bias_shape(self) -> tuple[int, int]:
        """``(MoE layers, experts)`` of the GPT's router bias."""
        return self.cfg.layers // self.cfg.moe.every, self.cfg.moe.experts

    @property
    def k(self) -> int:
        return self.step_kw.get("steps_per_call", 1)

    @property
    def mode(self) -> str:
        piped = self.sizes.get("pipe", 1) > 1
        sched = self.strategy.get("schedule", "1f1b")
        return {"pipedream-2bw": "delayed", "pipedream": "stash"}.get(sched, "sync") if piped else "sync"

    @property
    def dtype(self) -> str:
        return self.strategy.get("compute_dtype", "float32")

    @property
    def fp8(self):
        """The FP8 options (F8), ``None`` without."""
        return self.strategy.get("fp8")

    @property
    def m(self) -> int:
        return self.strategy.get("microbatches", 1)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (the data axes)."""
        return self.sizes.get("data", 1) * self.sizes.get("fsdp", 1)

    def setting(self) -> Setting:
        return Setting(jaxpar.Strategy(**self.strategy), self.sizes, explicit_dp=self.step_kw.get("explicit_dp"),
                       steps_per_call=self.k, clip_norm=self.step_kw.get("clip_norm"),
                       noise_scale_every=self.ns_every, ramp="fixed" if self.ramp else None,
                       ramp_steps=tuple(i for i in range(1, self.steps) if self.rows[i] != self.rows[i - 1]),
                       router_bias_rate=self.bias_rate, muon=(("blocks/w1", ()),) if self.tx == "muon" else None)


def build(codes, *, schedule: str | None = None) -> Spec:
    """The run of ``codes``' features together (see the module docstring for each feature)."""
    from jaxpar.parallel.compression import topk
    from jaxpar.parallel.sync import synchronous

    codes = tuple(codes)
    s = Spec(codes)
    st, sizes, kw = s.strategy, s.sizes, s.step_kw
    onebit = "1A" in codes
    for c in codes:
        if c == "Z":
            st["zero"] = 1 if onebit else 3        # 1-bit Adam: ZeRO-1 (ZeRO-2/3 refused)
        elif c in ("TP", "SP"):
            sizes["tensor"] = 2
            if c == "SP":
                st["sequence_parallel"] = True
        elif c == "MB":
            st["microbatches"] = 2
        elif c == "BF":
            st["compute_dtype"] = "bfloat16"
        elif c == "RM":
            s.remat = "full"
        elif c == "EX":
            kw["explicit_dp"] = True
        elif c in ("PP", "2B", "ST"):
            sizes["pipe"] = 2
            st["microbatches"] = 2
            st["schedule"] = schedule or {"PP": "1f1b", "2B": "pipedream-2bw", "ST": "pipedream"}[c]
            if st["schedule"] == "interleaved":
                st["virtual_stages"] = 2
                s.cfg = dataclasses.replace(PCFG, layers=4)
        elif c == "K":
            kw["steps_per_call"] = 2
            s.steps, s.rows = 4, (ROWS,) * 4
        elif c == "CP":
            st.setdefault("compression", topk(1.0))
        elif c == "LC":
            st.setdefault("compression", topk(1.0))
            st["local_clip"] = LOCAL_CLIP
        elif c == "1A":
            st["compression"] = topk(1.0, optimizer_momentum=0.9, start_step=1)
            s.tx = "frozen"
        elif c == "RS":
            sizes["replica"] = 2
            st["sync"] = synchronous()
        elif c == "CN":
            kw["clip_norm"] = CLIP
        elif c == "SN":
            kw["skip_nonfinite"] = True
            s.nan_step = 1
        elif c == "NS":
            s.ns_every = 2
        elif c == "BR":
            s.ramp = True
        elif c == "LL":
            s.tx = "lars"
        elif c == "CK":
            s.ckpt = True
        elif c == "CX":
            from jaxpar.parallel.context import ContextParallel

            sizes["context"] = 2
            st["context"] = ContextParallel("ring", balance=True)
        elif c == "EP":      # dropless (no capacity ties)
            from jaxpar.models import MoESettings

            sizes["expert"] = 2
            s.cfg = dataclasses.replace(s.cfg, mlp=32, moe=MoESettings(experts=4, top_k=2, capacity_factor=None,
                                                                       aux_weight=0.01, z_weight=1e-3))
        elif c == "RB":      # after EP: the bias alone balances, at a capacity that drops
            s.cfg = dataclasses.replace(s.cfg, mlp=32, moe=RB_MOE)
        elif c == "F8":      # every covered GEMM of the small GPT in FP8
            st["fp8"] = jaxpar.parallel.Fp8(min_dim=0)
        elif c == "MU":
            s.tx = "muon"
        elif c == "OF":      # the activations after the loop: a pair's own remat (RM) keeps its policy
            st["offload"] = jaxpar.parallel.Offload(optimizer=True, master=True)
        elif c != "MP":
            raise ValueError(c)
    if "OF" in codes and s.remat == "none" and sizes.get("pipe", 1) == 1:     # pipelines: PP x OF
        from jaxpar.options import LAYER_INPUT

        st["offload"] = dataclasses.replace(st["offload"], activations=(LAYER_INPUT,))
        s.remat = "offload"
    if "NS" in codes and "SN" in codes:
        s.steps, s.rows, s.nan_step = 4, (ROWS,) * 4, 2          # a measuring step is skipped
    if "RB" in codes and "SN" in codes:     # 3 steps move the bias (+-rate each), so it ends away from 0
        s.steps, s.rows = 4, (ROWS,) * 4
    if s.ramp:   # the batch doubles after the first call
        s.rows = tuple(ROWS if i < s.k else 2 * ROWS for i in range(s.steps))
    used = math.prod(sizes.values())
    if used < N_DEVICES:                                          # the rest of the devices: data
        sizes["data"] = sizes.get("data", 1) * (N_DEVICES // used)
    return s


# ------------------------------------------------------------------------------ the library run
def _loss_fn(nan: bool):
    from jaxpar.models import lm_loss

    if not nan:
        return lm_loss

    def scaled_loss(model, batch):           # NaN exactly where batch["scale"] is NaN
        import jax.numpy as jnp

        return lm_loss(model, batch) * jnp.mean(batch["scale"])

    return scaled_loss


def host_batch(spec: Spec, i: int) -> dict:
    from helpers import make_batch

    b = {k: np.asarray(v) for k, v in make_batch(spec.rows[i], spec.cfg, seed=i).items()}
    if spec.nan_step is not None:
        b["scale"] = np.full(spec.rows[i], np.nan if i == spec.nan_step else 1.0, np.float32)
    return b


def _model_fn(cfg, remat="none"):
    from flax import nnx

    from jaxpar.models import GPT

    cfg = dataclasses.replace(cfg, remat=remat)
    return lambda: GPT(cfg, rngs=nnx.Rngs(0))


def make_tx(spec: Spec, logical=None):
    import optax

    from jaxpar.optimizers import adamw_frozen_variance, lars, muon

    if spec.tx == "adamw":
        return optax.adamw(LR, weight_decay=0.1)
    if spec.tx == "frozen":
        return adamw_frozen_variance(LR, 1, eps=FROZEN_EPS, weight_decay=0.1)
    if spec.tx == "lars":
        return lars(0.1, weight_decay=1e-4, trust_coefficient=0.02, logical=logical)
    if spec.tx == "muon":
        return muon(MUON_LR, logical=logical, weight_decay=0.1, adam=dict(lr=LR, b2=0.999, weight_decay=0.1))
    raise ValueError(spec.tx)


def _to_host(x):
    """A global array on this host (gathered over processes where needed)."""
    import jax

    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _host_tree(tree):
    import jax

    return jax.tree.map(_to_host, tree)


@dataclasses.dataclass
class Result:
    losses: np.ndarray
    params: Any
    grads: Any                   # the first step's gradient as the optimizer got it (None: not recorded)
    metrics: list                # one dict per optimizer step
    stats: Any = None
    resumed: Any = None          # CK: (losses after the restore, params, stats with RB) of the resumed run


def execute(spec: Spec, mesh=None) -> Result:
    """Run ``spec`` through :func:`jaxpar.run.train` (the loop users run)."""
    import jax
    import optax

    from helpers import keep_grads
    from jaxpar.run import Checkpointer
    from jaxpar.run import train
    from jaxpar.step import with_noise_scale, with_router_bias

    model_fn = _model_fn(spec.cfg, spec.remat)
    if mesh is None:
        n = math.prod(spec.sizes.values())
        mesh = jaxpar.make_mesh(spec.sizes, devices=jax.devices()[:n])
    strategy = jaxpar.Strategy(**spec.strategy)
    tx = optax.chain(keep_grads(), make_tx(spec, _logical(spec.cfg)))
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    if spec.ns_every:          # the measurement's option is the state part's, not make_train_step's
        state, layout = with_noise_scale(state, layout, every=spec.ns_every)
    if spec.bias_rate:         # as is the router bias's rate
        state, layout = with_router_bias(state, layout, spec.bias_shape, rate=spec.bias_rate)
    step = jaxpar.make_train_step(_loss_fn(spec.nan_step is not None), tx, layout, strategy, **spec.step_kw)
    k = spec.k

    def recorder(records, first):
        def wrapped(state, batch):
            state, metrics = step(state, batch)
            metrics = _host_tree(metrics)
            records.extend([{key: v[i] for key, v in metrics.items()} for i in range(k)] if k > 1 else [metrics])
            kept = getattr(state.opt_state[0], "grads", None) if spec.mode != "stash" else None
            if not first and k == 1 and kept is not None:
                first.append(_host_tree(kept))    # the first step's gradient, before the next call donates it
            return state, metrics
        return wrapped

    loop = dict(mesh=mesh, steps_per_call=k, on_nonfinite="skip" if spec.nan_step is not None else "stop",
                handle_signals=False, progress="none", log_every=k)
    records, first = [], []
    batch_fn = functools.partial(host_batch, spec)
    resumed = None
    if not spec.ckpt:
        state, _ = train(recorder(records, first), state, batch_fn, steps=spec.steps, **loop)
    else:                       # save after the first call, go on; restore the save and go on again
        cut = k
        with tempfile.TemporaryDirectory() as d:
            state, _ = train(recorder(records, first), state, batch_fn, steps=cut, **loop)
            with Checkpointer(d, async_save=False) as ck:
                ck.save(cut, state, {}, wait=True)
            state, _ = train(recorder(records, first), state, batch_fn, steps=spec.steps - cut, **loop)
            with Checkpointer(d, async_save=False) as ck:
                restored = ck.restore(layout).state
            again = []
            restored, _ = train(recorder(again, [None]), restored, batch_fn, steps=spec.steps - cut, **loop)
            resumed = (np.array([float(m["loss"]) for m in again]), _host_tree(restored.params),
                       _host_tree(restored.stats) if spec.bias_rate else None)
    stats = _host_tree(state.stats) if spec.ns_every or spec.bias_rate else None
    return Result(np.array([float(m["loss"]) for m in records]), _host_tree(state.params), first[0] if first else None,
                  records, stats, resumed)


# ------------------------------------------------------------------------------ the reference
@dataclasses.dataclass
class Reference:
    losses: np.ndarray
    params: Any
    grads: Any                   # the first step's (or first update's) gradient
    norms: dict                  # step -> (mean over replicas of |g_r|^2, |mean g_r|^2)
    updates: int                 # optimizer updates applied (per stage for stashing)
    bound: Any = None            # frozen-variance Adam: the per-element parameter bound (_frozen_bound)
    bias: Any = None             # RB: the router bias after the run


@functools.lru_cache(maxsize=None)
def _grad_fn(cfg, dtype: str, nan: bool, fp8=None):
    """``(params, batch) -> (loss, grads)`` on one device, the parameters cast to ``dtype``. With a
    router bias (RB: ``cfg.moe.bias_rate``): ``(params, bias, batch) -> ((loss, loads), grads)``, the
    MoE layers choosing their experts with ``bias`` and ``loads`` each one's load per expert
    ``[layers, E]``, as the GPT reports them inside a step (:func:`jaxpar.parallel.moe.balanced`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.parallel import fp8_loss

    graphdef = nnx.graphdef(_model_fn(cfg)())
    loss_fn = fp8_loss(_loss_fn(nan), fp8)
    cast = (lambda p: p) if dtype == "float32" else (lambda p: jax.tree.map(lambda a: a.astype(jnp.bfloat16), p))
    if not getattr(cfg.moe, "bias_rate", 0.0):
        return jax.jit(jax.value_and_grad(lambda p, b: loss_fn(nnx.merge(graphdef, cast(p)), b)))
    from jaxpar.adapters._loss_metrics import with_reported_metrics
    from jaxpar.parallel.moe import LAYER_LOADS, balanced, use_router_bias

    def biased(p, bias, b):
        with use_router_bias(bias):
            loss, found = with_reported_metrics(balanced(lambda q, x: loss_fn(nnx.merge(graphdef, cast(q)), x)))(p, b)
        return loss, found[LAYER_LOADS]

    return jax.jit(jax.value_and_grad(biased, has_aux=True))


def _moved_bias(bias, loads, rate):
    """The router bias after a step of ``loads`` ``[layers, E]`` (summed over the step's micro-batches
    and replicas): each layer's row by the sign rule, :func:`jaxpar.parallel.moe.update_router_bias`."""
    from jaxpar.parallel.moe import update_router_bias

    return np.stack([np.asarray(update_router_bias(b, load, rate)) for b, load in zip(bias, loads)])


def _init_params(cfg):
    import jax
    from flax import nnx

    return jax.device_get(nnx.to_pure_dict(nnx.state(_model_fn(cfg)(), nnx.Param)))


def _tree_sq(tree) -> float:
    import jax

    return float(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(tree)))


def _mean(trees):
    import jax

    return jax.tree.map(lambda *g: sum(np.asarray(x, np.float64) for x in g) / len(g), *trees)


@functools.lru_cache(maxsize=None)
def _reference_cached(key):
    return _reference(Spec(**dict(key)))


def reference(spec: Spec) -> Reference:
    """The one-device run of what ``spec`` means (cached over the fields that change the numbers)."""
    fields = dict(codes=(), strategy=_ref_strategy(spec), step_kw=_ref_step_kw(spec), ns_every=spec.ns_every,
                  tx=spec.tx, cfg=spec.cfg, steps=spec.steps, rows=spec.rows, nan_step=spec.nan_step,
                  sizes=_ref_sizes(spec))
    key = tuple((k, _freeze(v)) for k, v in fields.items())
    return _reference_cached(key)


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


def _ref_strategy(spec):
    keep = ("compute_dtype", "microbatches", "schedule", "local_clip", "fp8")
    out = {k: v for k, v in spec.strategy.items() if k in keep}
    if spec.sizes.get("pipe", 1) == 1:
        out.pop("schedule", None)
    return out


def _ref_step_kw(spec):
    kw = {k: v for k, v in spec.step_kw.items() if k in ("clip_norm",)}
    return kw


def _ref_sizes(spec):
    """What of the mesh the reference needs: the replicas (local clip, noise scale), the pipe."""
    out = {}
    if spec.strategy.get("local_clip") or spec.ns_every or (spec.fp8 and spec.strategy.get("compression")):
        out["data"] = spec.replicas
    if spec.fp8 and spec.sizes.get("replica", 1) > 1:      # FP8: each replica's gradient with its own scales
        out["replica"] = spec.sizes["replica"]
    if spec.sizes.get("pipe", 1) > 1:
        out["pipe"] = spec.sizes["pipe"]
    return out


def _reference(spec: Spec) -> Reference:
    import jax
    import optax

    spec.strategy = dict(spec.strategy)
    spec.step_kw = dict(spec.step_kw)
    spec.sizes = dict(spec.sizes)
    if spec.mode == "stash":
        return _stash_reference(spec)
    grad = _grad_fn(spec.cfg, spec.dtype, spec.nan_step is not None, spec.fp8)
    params = _init_params(spec.cfg)
    tx = make_tx(spec, _logical(spec.cfg))
    opt = tx.init(params)
    prev = params
    delayed = spec.mode == "delayed"
    m, clip, local = spec.m, spec.step_kw.get("clip_norm"), spec.strategy.get("local_clip")
    if getattr(spec.cfg.moe, "aux_weight", 0):   # the MoE balancing loss is the whole batch's (the step's pre-pass)
        m = 1
    every, rate = spec.ns_every, spec.bias_rate
    bias = np.zeros(spec.bias_shape, np.float32) if rate else None       # RB: moved after every step
    r_count = spec.sizes.get("data", 1) * spec.sizes.get("replica", 1)     # the replicas of _ref_sizes
    losses, norms, first, updates, bound = [], {}, None, 0, None
    for t in range(spec.steps):
        batch = host_batch(spec, t)
        rows = spec.rows[t]
        w = prev if delayed else params
        per, loss, loads = [], 0.0, 0.0
        whole = spec.fp8 and every and t % every and not local      # FP8: a step that does not measure
        for r in range(1 if whole else r_count):        # each replica's rows, contiguous; its micro-batches, strided
            n = 1 if whole else r_count
            mine = {k: v[r * rows // n:(r + 1) * rows // n] for k, v in batch.items()}
            gs = []
            for j in range(m):
                mb = {k: v[j::m] for k, v in mine.items()}
                if rate:
                    (lj, lo), gj = grad(w, bias, mb)
                    loads = loads + np.asarray(lo)        # counts: the sum is exact
                else:
                    lj, gj = grad(w, mb)
                loss += float(lj) / (m * n)
                gs.append(jax.device_get(gj))
            per.append(_mean(gs))
        g = _mean(per)
        if every and t % every == 0:
            norms[t] = (float(np.mean([_tree_sq(x) for x in per])), _tree_sq(g))
        if local:
            scaled = []
            for x in per:
                n = math.sqrt(_tree_sq(x))
                scaled.append(jax.tree.map(lambda a, f=min(1.0, local / (n + 1e-6)): a * f, x))
            g = _mean(scaled)
        g = jax.tree.map(lambda a: np.asarray(a, np.float32), g)
        losses.append(loss)
        norm = math.sqrt(_tree_sq(g))
        if spec.nan_step is not None and not (math.isfinite(loss) and math.isfinite(norm)):
            if delayed:
                prev = params                     # 2BW: a skipped step keeps W(t) and makes it the older version
            continue                              # (and the router bias: the skipped step changes no state)
        if rate:
            bias = _moved_bias(bias, loads, rate)
        if clip is not None:
            g = jax.tree.map(lambda a: np.float32(a * min(1.0, clip / (norm + 1e-6))), g)
        if first is None:
            first = g                             # what the optimizer gets (after the clip)
        u, opt = tx.update(g, opt, params)
        if spec.tx == "frozen":
            bound = _frozen_bound(bound, g, opt[0], *_grad_tolerance(spec))
        prev, params = params, jax.device_get(optax.apply_updates(params, u))
        updates += 1
    return Reference(np.array(losses), params, first, norms, updates, bound if spec.tx == "frozen" else None, bias)


def _frozen_bound(bound, g, adam, rtol, atol_rel, *, b1=0.9, b2=0.999, eps=None, freeze=1):
    """How far an update of ``adamw_frozen_variance`` can carry the gradient tolerance
    (``delta = rtol |g| + atol_rel x the leaf's largest``), to first order, added to ``bound``.

    The update is ``lr m_hat / (sqrt(v_hat) + eps)`` with ``v_hat`` frozen after ``freeze``
    updates, so unlike Adam's (helpers.adam_atol) it is not bounded by ~lr: an element whose
    gradient was ~0 when the variance froze takes steps of ``lr m_hat / eps``. A change ``delta`` of
    the gradients moves ``m_hat`` by at most ``delta`` and ``sqrt(v_hat)`` by at most ``delta``
    (weighted mean and 2-norm), so the update by at most ``lr (delta / s + |m_hat| delta / s^2)``,
    ``s = sqrt(v_hat) + eps``, with this step's ``m_hat``, ``v_hat`` (the reference's)."""
    import jax

    eps = FROZEN_EPS if eps is None else eps
    count = int(adam.count)
    c1, c2 = 1 - b1 ** count, 1 - b2 ** min(count, freeze)

    def one(b, gl, mu, nu):
        gl = np.abs(np.asarray(gl, np.float64))
        delta = rtol * gl + atol_rel * gl.max(initial=0.0)
        s = np.sqrt(np.asarray(nu, np.float64) / c2) + eps
        step = LR * (delta / s + np.abs(np.asarray(mu, np.float64) / c1) * delta / s ** 2)
        return step if b is None else b + step

    if bound is None:
        return jax.tree.map(lambda gl, mu, nu: one(None, gl, mu, nu), g, adam.mu, adam.nu)
    return jax.tree.map(one, bound, g, adam.mu, adam.nu)


@functools.lru_cache(maxsize=None)
def _logical(cfg):
    """The logical names of the GPT's parameters (per-layer LARS)."""
    try:
        from jaxpar.adapters import abstract_model
    except ImportError:          # where it was before
        from jaxpar.step._state import abstract_model

    return abstract_model(_model_fn(cfg))[2]


def _stash_reference(spec: Spec) -> Reference:
    """Weight stashing on one device (as tests/test_weight_stashing.py's reference, update_every 1,
    no vertical sync): stage s runs micro-batch i on its version ``max(0, i - (p-1-s))`` and
    updates after each of its backwards; a non-finite update keeps the version (and is still one)."""
    import jax
    import optax

    p, m = spec.sizes["pipe"], spec.m
    grad = _grad_fn(spec.cfg, spec.dtype, spec.nan_step is not None, spec.fp8)
    w0 = _init_params(spec.cfg)
    tx = make_tx(spec, _logical(spec.cfg))
    hist = [[w0] for _ in range(p)]
    opt = [tx.init(w0) for _ in range(p)]
    per = spec.cfg.layers // p
    losses, first, updates = [], None, 0
    for t in range(spec.steps):
        batch = host_batch(spec, t)
        total = 0.0
        for j in range(m):
            i = t * m + j
            v = [max(0, i - (p - 1 - s)) for s in range(p)]
            loss, g = grad(_assemble([hist[s][v[s]] for s in range(p)], per), {k: x[j::m] for k, x in batch.items()})
            g = jax.device_get(g)
            total += float(loss) / m
            ok = math.isfinite(_tree_sq(g))
            first = g if first is None and ok else first
            for s in range(p):
                if ok or spec.nan_step is None:
                    u, opt[s] = tx.update(g, opt[s], hist[s][-1])
                    hist[s].append(jax.device_get(optax.apply_updates(hist[s][-1], u)))
                else:
                    hist[s].append(hist[s][-1])
            updates += ok
        losses.append(total)
    return Reference(np.array(losses), _assemble([h[-1] for h in hist], per), first, {}, updates)


_PRE, _POST = ("wte", "wpe"), ("lnf_scale", "lnf_bias", "head")    # the GPT's leaves before / after the blocks


def _assemble(stage_trees, per):
    p = len(stage_trees)
    w = {n: stage_trees[0][n] for n in _PRE} | {n: stage_trees[p - 1][n] for n in _POST}
    w["blocks"] = {k: np.concatenate([np.asarray(t["blocks"][k])[s * per:(s + 1) * per]
                                      for s, t in enumerate(stage_trees)]) for k in stage_trees[0]["blocks"]}
    return w


# ------------------------------------------------------------------------------ comparing
#: bf16 against the one-device bf16 run of the same micro-batches. On one device the library's
#: bf16 step is that run bit for bit; on a mesh the products are the same bf16 roundings after
#: sums in another order and grouping (the stages, the replicas' and the tensor axis' reductions),
#: and every rounding of bf16 (8 significant bits: unit round-off u = 2^-8 = 3.9e-3) can land the
#: other way. Either run is ~0.7% (median, relative) from the fp32 gradient here, and the two are
#: as far from each other: seen (DP8, tensor 2, 1F1B, interleaved, 2BW, codecs, replicas) gradients
#: within 2.05e-2 of the leaf's largest (~5u), median 0.5-1.1% (~2u), losses within 5.3e-5 (the
#: loss itself moves only 5e-5 from fp32 to bf16 at this init: the logits are small).
#: Allowed: gradients rtol 3e-2 + 3e-2 x the leaf's largest (~8u), losses 5e-4 (10x the bf16 effect
#: on the loss), parameters Adam's bound (helpers.adam_atol) for that gradient tolerance. The cast
#: must have happened: the gradients are >= 1e-3 (median, relative) from the fp32 ones (fp32
#: round-off: 1e-6), else the losses differ from the fp32 run's.
BF16_LOSS_RTOL, BF16_GRAD_RTOL, BF16_GRAD_ATOL_REL = 5e-4, 3e-2, 3e-2
#: FP8 (F8) against the one-device FP8 run of the same micro-batches (and, where each replica computes
#: its own gradient, the same replicas: jaxpar.parallel._fp8.own_scales). Both quantize the same
#: tensors with the same scales; they differ where a sum in another order puts an operand element on
#: the other side of an FP8 rounding boundary: one ulp (2^-3 relative in e4m3) of one element. Seen
#: over the 25 pairs: per leaf |g - g_F8| <= 2.6e-4 x |g_F8 - g_fp32| (the FP8 rounding's own effect),
#: parameters <= 2.6e-2 x theirs after 3 AdamW steps. Allowed on top of the fp32 tolerances: each
#: first-gradient element 1e-2 x the leaf's largest FP8 effect |g_F8 - g_fp32|; each parameter 0.1 x
#: the leaf's largest |p_F8 - p_fp32| (Adam's bound for a first-gradient tolerance does not hold: a
#: flip at a later step moves an element whose first gradient was ~0, e.g. wk at init). FP8 must have
#: run the same way: per leaf |g - g_F8| <= FP8_SAME x |g_F8 - g_fp32| (first gradient), |p - p_F8| <=
#: FP8_SAME_PARAMS x |p_F8 - p_fp32| (parameters; 1 for a run without FP8).
FP8_FLIP, FP8_PARAM_FLIP, FP8_SAME, FP8_SAME_PARAMS = 1e-2, 0.1, 1e-2, 0.1
#: FP8 under bf16 compute (BF + F8): a sum in another order moves an operand by a bf16 ulp (2^-8 relative),
#: 1/16 to 1/32 of an e4m3 ulp, so a large share of the roundings is drawn again, not one element's. Measured
#: for BF-F8 (data 8 against one device): per leaf max |g - g_F8| is 0.22-1.0 x the FP8 effect (0.00016 for
#: the same pair in fp32 compute), the parameters 0.02-0.95 x theirs. Allowed: 1 x the leaf's FP8 effect,
#: gradients and parameters. That FP8 ran is then read from the other side: the run is as far from the
#: one-device run without FP8 as FP8 moved that one (measured 0.93-1.15 x per leaf; a run without FP8 would
#: be bf16's reordering, 0.02 x): at least FP8_MOVED_BF16 x.
FP8_FLIP_BF16, FP8_MOVED_BF16 = 1.0, 0.5


def _flat(tree) -> dict:
    from helpers import flat

    return flat(tree)


def _adam_bound(g1, lr, steps, grad_rtol, grad_atol_rel, b1=0.9, b2=0.999, eps=1e-8):
    """tests/helpers.py's :func:`adam_atol` for another gradient tolerance."""
    g = np.abs(np.asarray(g1, np.float64))
    delta = grad_rtol * g + grad_atol_rel * float(np.max(g, initial=0.0))
    total = np.zeros_like(g)
    for t in range(1, steps + 1):
        i = np.arange(1, t + 1)
        w = (1 - b1) * b1 ** (t - i) / (1 - b1 ** t)
        u = (1 - b2) * b2 ** (t - i) / (1 - b2 ** t)
        r = np.sqrt(np.sum(w ** 2 / u))
        total += np.minimum(2 * r, (1 + r) * delta / (np.sqrt(u[0]) * g + eps))
    return lr * total


def _muon_keys(spec: Spec) -> set[str]:
    """MU: the parameters Muon updates (the others are its AdamW half's); without MU, none."""
    if spec.tx != "muon":
        return set()
    from jaxpar.adapters import abstract_model
    from jaxpar.optimizers import muon_routing

    return {k for k, rule in muon_routing(*abstract_model(_model_fn(spec.cfg))[1:]).items() if rule == "muon"}


def _grad_tolerance(spec: Spec) -> tuple[float, float]:
    """``(rtol, atol as a fraction of the leaf's largest)`` of the gradients."""
    return (BF16_GRAD_RTOL, BF16_GRAD_ATOL_REL) if spec.dtype == "bfloat16" else (1e-4, 1e-5)


def _fp8_effect(spec: Spec, ref: Reference, field: str) -> dict:
    """F8: per leaf, the largest |x_F8 - x_fp32| of the one-device runs' ``field`` (``grads``: the first
    gradients, ``params``: the parameters after the run); without F8, nothing."""
    if not spec.fp8 or getattr(ref, field) is None:
        return {}
    fp32 = getattr(reference(dataclasses.replace(spec, strategy={k: v for k, v in spec.strategy.items() if k != "fp8"})),
                   field)
    return {k: float(np.abs(x - _flat(fp32)[k]).max()) for k, x in _flat(getattr(ref, field)).items()}


def assert_matches(res: Result, ref: Reference, spec: Spec, what: str = ""):
    """Losses of every step, the first gradient, the parameters after the run (see the module
    docstring for the tolerances)."""
    bf16 = spec.dtype == "bfloat16"
    flip = {k: (FP8_FLIP_BF16 if bf16 else FP8_FLIP) * v for k, v in _fp8_effect(spec, ref, "grads").items()}
    moved = {k: (FP8_FLIP_BF16 if bf16 else FP8_PARAM_FLIP) * v for k, v in _fp8_effect(spec, ref, "params").items()}
    loss_rtol = BF16_LOSS_RTOL if bf16 else 1e-5
    grad_rtol, grad_atol_rel = _grad_tolerance(spec)
    assert len(res.losses) == len(ref.losses), (res.losses, ref.losses)
    np.testing.assert_allclose(res.losses, ref.losses, rtol=loss_rtol, err_msg=f"{what} losses per step")
    if res.grads is not None and ref.grads is not None and spec.mode != "stash":
        got, want = _flat(res.grads), _flat(ref.grads)
        assert got.keys() == want.keys()
        for key, g in got.items():
            w = want[key]
            np.testing.assert_allclose(g, w, rtol=grad_rtol, atol=grad_atol_rel * np.abs(w).max() + flip.get(key, 0.0),
                                       err_msg=f"{what} first-step gradient {key}")
    got, want, g1 = _flat(res.params), _flat(ref.params), _flat(ref.grads)
    init = _flat(_init_params(spec.cfg))
    muon_keys = _muon_keys(spec)
    assert got.keys() == want.keys()
    for key, p in got.items():
        r = want[key].astype(np.float64)
        diff = np.abs(p.astype(np.float64) - r)
        if spec.tx == "lars" or key in muon_keys:    # momentum SGD / Newton-Schulz: smooth in the gradients
            tol = 1e-4 * np.abs(r) + 1e-6 + max(grad_rtol * 10, 1e-3) * np.abs(r - init[key]).max()
        elif spec.tx == "frozen":
            tol = 1e-4 * np.abs(r) + 1e-6 + _flat(ref.bound)[key]
        else:
            tol = 1e-4 * np.abs(r) + 1e-6 + _adam_bound(g1[key], LR, ref.updates, grad_rtol, grad_atol_rel)
        tol = tol + moved.get(key, 0.0)
        bad = diff > tol
        assert not bad.any(), (f"{what} parameter {key}: {int(bad.sum())} / {diff.size} beyond tolerance, "
                               f"worst |diff| {diff.max():.3g} (tol there {tol.flat[np.argmax(diff)]:.3g})")


def check_pair(spec: Spec, res: Result):
    """``res`` (the library's run of ``spec``) against the reference and the pair's own checks."""
    ref = reference(spec)
    what = "+".join(spec.codes)
    assert_matches(res, ref, spec, what)
    steps = res.metrics
    if spec.dtype == "bfloat16":      # the cast happened: the gradients (or losses) are not the fp32 ones
        fp32 = reference(dataclasses.replace(spec, strategy={**spec.strategy, "compute_dtype": "float32"}))
        if res.grads is not None and fp32.grads is not None and spec.mode != "stash":
            got, want = _flat(res.grads), _flat(fp32.grads)
            rel = np.concatenate([(np.abs(got[k] - w) / (np.abs(w) + 1e-30)).ravel() for k, w in want.items()])
            assert np.median(rel) >= 1e-3, f"{what}: the bf16 gradient is the fp32 one ({np.median(rel):.2g})"
        else:
            assert not np.allclose(res.losses, fp32.losses, rtol=1e-6, atol=0), f"{what}: bf16 run equals the fp32 one"
    if spec.fp8:
        _check_fp8_ran(spec, res, ref, what)
    if "CN" in spec.codes:
        assert float(steps[0]["grad_norm"]) > CLIP                    # so it clipped
    if spec.strategy.get("local_clip"):
        assert float(steps[0]["replica_grad_norm"]) > LOCAL_CLIP
    if spec.nan_step is not None:
        assert [bool(m["skipped"]) for m in steps] == [i == spec.nan_step for i in range(spec.steps)]
    if spec.ns_every:
        measured = [t for t in ref.norms if t != spec.nan_step]
        for t in measured:
            small, big = ref.norms[t]
            rtol = 1e-5 if t == 0 else 1e-4                           # later: parameters within Adam's bound
            if spec.dtype == "bfloat16":
                rtol = BF16_GRAD_RTOL
            np.testing.assert_allclose(float(steps[t]["grad_sq_small"]), small, rtol=rtol, err_msg=f"{what} step {t}")
            np.testing.assert_allclose(float(steps[t]["grad_sq_big"]), big, rtol=rtol, err_msg=f"{what} step {t}")
        assert [t for t, m in enumerate(steps) if "grad_sq_big" in m] == list(range(0, spec.steps, spec.ns_every))
        assert int(res.stats["noise_scale"]["count"]) == len(measured)
    if spec.ckpt:                     # the resumed run is the uninterrupted one, bit for bit
        losses, params, stats = res.resumed
        np.testing.assert_array_equal(losses, res.losses[spec.k:])
        for key, p in _flat(params).items():
            np.testing.assert_array_equal(p, _flat(res.params)[key], err_msg=key)
        if spec.bias_rate:
            np.testing.assert_array_equal(stats["router_bias"], res.stats["router_bias"], err_msg="resumed bias")
    if spec.bias_rate:
        _check_router_bias(spec, res, ref, what)


def _check_fp8_ran(spec: Spec, res: Result, ref: Reference, what: str):
    """F8: the run is far closer to the one-device FP8 run than that run is to fp32 (the first
    gradient per leaf, else the parameters: :data:`FP8_SAME`), and FP8 changed the numbers; under bf16
    compute, the run is as far from the one-device run without FP8 as FP8 moved that one
    (:data:`FP8_MOVED_BF16`)."""
    fp32 = reference(dataclasses.replace(spec, strategy={k: v for k, v in spec.strategy.items() if k != "fp8"}))
    both = res.grads is not None and ref.grads is not None and spec.mode != "stash"
    got, want, plain = (_flat(t) for t in ((res.grads, ref.grads, fp32.grads) if both else
                                            (res.params, ref.params, fp32.params)))
    bound = FP8_SAME if both else FP8_SAME_PARAMS
    effect = {k: np.linalg.norm(want[k] - plain[k]) for k in want}
    assert sum(effect.values()) > 0, f"{what}: the FP8 run equals the fp32 one"
    if spec.dtype == "bfloat16":
        for k, e in effect.items():
            assert np.linalg.norm(got[k] - plain[k]) >= FP8_MOVED_BF16 * e, \
                f"{what} {k}: |run - run without FP8| {np.linalg.norm(got[k] - plain[k]):.3g} < {FP8_MOVED_BF16} x " \
                f"FP8's effect {e:.3g}: did FP8 run?"
        return
    for k, e in effect.items():
        assert np.linalg.norm(got[k] - want[k]) <= bound * e + 1e-12, \
            f"{what} {k}: |run - FP8 reference| {np.linalg.norm(got[k] - want[k]):.3g} > {bound} x FP8's effect {e:.3g}"


def _check_router_bias(spec: Spec, res: Result, ref: Reference, what: str):
    """RB: the bias after the run is the one-device one exactly (it moves by the sign of each step's
    loads: counts, equal on every mesh), it moved, and it changed the computation (the one-device run
    without it has other losses)."""
    bias = res.stats["router_bias"]
    np.testing.assert_array_equal(bias, ref.bias, err_msg=f"{what}: the router bias")
    assert np.abs(bias).max() > 0, f"{what}: the router bias did not move"
    plain = reference(dataclasses.replace(spec, cfg=dataclasses.replace(
        spec.cfg, moe=dataclasses.replace(spec.cfg.moe, bias_rate=0.0))))
    assert not np.allclose(ref.losses, plain.losses, rtol=1e-6, atol=0, equal_nan=True), \
        f"{what}: the bias changed no loss ({ref.losses} without it: {plain.losses})"


# ------------------------------------------------------------------------------ the pairs
#: One case per feature in the default run (with the dedicated tests of section 4: NS x PP and
#: BF x 2BW); the rest in the exhaustive tier.
FAST = {("SP", "CP"), ("MB", "RS"), ("LC", "LL"), ("RM", "ST"), ("EX", "CN"), ("K", "SN"),
        ("TP", "1A"), ("BF", "CK"), ("Z", "CX"), ("TP", "EP"), ("CP", "RB"), ("CP", "MU")}


def _pair_params():
    out = []
    for pair in _harness_pairs():
        marks = [] if pair in FAST else [pytest.mark.exhaustive]
        out.append(pytest.param(pair, id=f"{pair[0]}-{pair[1]}", marks=marks))
    return out


@pytest.mark.parametrize("pair", _pair_params())
def test_pair_matches_its_reference(pair):
    spec = build(pair)
    settable = [c for c in pair if c not in UNSETTABLE]
    assert all(_feature(c).on(spec.setting()) for c in settable), f"{pair}: not both on in {spec.setting()}"
    check_pair(spec, execute(spec))


# ============================================================== 4. the cases asked for by name
FLUSH = ["1f1b", "gpipe", "interleaved", "zb-h1"]


def _measuring_and_plain_step(spec: Spec):
    """One step from the same state by the measuring program and by the plain one: ``(measured
    metrics, plain metrics, params after each, first gradients after each)``."""
    import jax
    import optax

    from helpers import keep_grads
    from jaxpar.step import with_noise_scale

    model_fn = _model_fn(spec.cfg)
    mesh = jaxpar.make_mesh(spec.sizes, devices=jax.devices()[:math.prod(spec.sizes.values())])
    strategy = jaxpar.Strategy(**spec.strategy)
    tx = optax.chain(keep_grads(), make_tx(spec))
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    measured, measured_layout = with_noise_scale(state, layout, every=1)     # the same params, plus the part
    loss = _loss_fn(False)
    measure = jaxpar.make_train_step(loss, tx, measured_layout, strategy, donate=False)
    plain = jaxpar.make_train_step(loss, tx, layout, strategy, donate=False)
    batch = jaxpar.shard_batch(host_batch(spec, 0), mesh)
    out = []
    for step, start in ((measure, measured), (plain, state)):
        new, metrics = step(start, batch)
        out.append((_host_tree(metrics), _host_tree(new.params), _host_tree(new.opt_state[0].grads)))
    return out


def _assert_same_update(spec: Spec):
    """The measuring step's update is the plain step's: the same gradient (fp32 round-off: the
    measuring program reduces the replicas' gradients itself) and the parameters after one AdamW step."""
    (m1, p1, g1), (m2, p2, g2) = _measuring_and_plain_step(spec)
    assert "grad_sq_big" in m1 and "grad_sq_big" not in m2
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    got, want = _flat(g1), _flat(g2)
    for key, g in got.items():
        np.testing.assert_allclose(g, want[key], rtol=1e-5, atol=1e-6 * np.abs(want[key]).max(), err_msg=key)
    want_p = _flat(p2)
    for key, p in _flat(p1).items():
        tol = 1e-6 * np.abs(want_p[key]) + 1e-7 + _adam_bound(want[key], LR, 1, 1e-5, 1e-6)
        assert (np.abs(p - want_p[key]) <= tol).all(), key
    np.testing.assert_allclose(float(m1["grad_norm"]) ** 2, float(m1["grad_sq_big"]), rtol=1e-5)


@pytest.mark.exhaustive
@pytest.mark.parametrize("schedule", FLUSH)
def test_noise_scale_with_a_flush_pipeline(schedule):
    """pipe 2 x data 4: the measured ``grad_sq_small`` / ``grad_sq_big`` equal the squared norms of the
    4 replicas' gradients materialised on one device (as tests/test_noise_scale.py does for DP8),
    at steps 0 and 2 of 3 (every 2); the run is the one-device run; and the measuring step's update
    equals the non-measuring step's."""
    spec = build(("PP", "NS"), schedule=schedule)
    assert spec.sizes == {"pipe": 2, "data": 4} and spec.strategy["schedule"] == schedule
    check_pair(spec, execute(spec))
    _assert_same_update(spec)


@pytest.mark.exhaustive
@pytest.mark.parametrize("ratio", [1.0, 0.1], ids=["lossless", "topk-0.1"])
def test_noise_scale_with_a_codec(ratio):
    """DP8 with top-k: lossless (ratio 1): the run is the exact one-device run, the measured norms
    equal the exact ones (the uncompressed measuring run's and the materialised replicas'), and
    the measuring step's update is the plain step's. Lossy (top-k 10%): the first step's norms
    (same parameters) are still the exact ones: ``grad_sq_big`` comes from an exact all-reduce."""
    from jaxpar.parallel.compression import topk

    spec = build(("CP", "NS"))
    spec.strategy["compression"] = topk(ratio)
    assert spec.sizes == {"data": 8}
    res = execute(spec)
    if ratio == 1.0:
        check_pair(spec, res)
        exact = execute(build(("NS",)))
        for t in (0, 2):
            for k in ("grad_sq_small", "grad_sq_big"):
                np.testing.assert_allclose(float(res.metrics[t][k]), float(exact.metrics[t][k]), rtol=1e-5)
        _assert_same_update(spec)
    else:
        small, big = reference(spec).norms[0]
        np.testing.assert_allclose(float(res.metrics[0]["grad_sq_small"]), small, rtol=1e-5)
        np.testing.assert_allclose(float(res.metrics[0]["grad_sq_big"]), big, rtol=1e-5)
        assert float(res.metrics[0]["comm_ratio"]) < 1 and float(res.metrics[0]["residual_norm"]) > 0   # lossy


SCHEDULES = {"1f1b": ("PP", "1f1b"), "gpipe": ("PP", "gpipe"), "interleaved": ("PP", "interleaved"),
             "zb-h1": ("PP", "zb-h1"), "pipedream-2bw": ("2B", None), "pipedream": ("ST", None)}


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=[] if s == "pipedream-2bw" else [pytest.mark.exhaustive])
                                      for s in SCHEDULES])
def test_bf16_under_every_schedule(schedule):
    """bf16 compute with fp32 master weights on pipe 2 x data 4, against the one-device bf16 run of
    the same micro-batches with the schedule's semantics (flush: plain; 2BW: the gradient at
    ``W(t-1)``; stashing: per stage), within :data:`BF16_LOSS_RTOL` & co.; the run differs from the
    fp32 one (the cast happened) and the parameters stay fp32."""
    code, sched = SCHEDULES[schedule]
    spec = build(("BF", code), schedule=sched)
    res = execute(spec)
    check_pair(spec, res)
    assert {np.asarray(a).dtype for a in _flat(res.params).values()} == {np.dtype("float32")}


@pytest.mark.exhaustive
@pytest.mark.parametrize("zero", [1, 3])
def test_sequence_parallel_with_accumulation_and_zero(zero):
    """data 4 x tensor 2, sequence parallelism, 2 micro-batches, ZeRO-1 / ZeRO-3: the one-device run."""
    spec = build(("Z", "SP", "MB"))
    spec.strategy["zero"] = zero
    assert spec.sizes == {"data": 4, "tensor": 2} and spec.m == 2
    check_pair(spec, execute(spec))


# ================================================================ 5. several processes (MP)
def _mp_params():
    return [pytest.param(p, id=f"{p[0]}-{p[1]}", marks=[] if p == ("PP", "MP") else [pytest.mark.exhaustive])
            for p in MP_PAIRS]


@pytest.fixture(scope="module")
def two_processes(request, tmp_path_factory):
    """One job of 2 processes x 4 devices runs every selected MP pair (this file as the driver)."""
    from test_multiprocess import free_port, launch, wait_all

    names = sorted({f"{i.callspec.params['pair'][0]}-{i.callspec.params['pair'][1]}" for i in request.session.items
                    if getattr(i, "originalname", None) == "test_pair_on_two_processes"})
    out = tmp_path_factory.mktemp("two-processes")
    port = free_port()
    procs = launch(lambda i: [sys.executable, "tests/test_pairs.py", "mp", f"127.0.0.1:{port}", "2", str(i), "4",
                              str(out), *names], 2, out)
    wait_all(procs, out, timeout=120 + 90 * len(names))
    return out


@pytest.mark.parametrize("pair", _mp_params())
def test_pair_on_two_processes(pair, two_processes):
    """The pair's other feature on 2 processes x 4 devices (the first mesh axis across the
    processes: pipe, replica or data) against the one-device reference, as the harness does on one process."""
    import pickle

    other = tuple(c for c in pair if c != "MP")
    spec = build(other)
    err = two_processes / f"{pair[0]}-{pair[1]}.err"
    assert not err.exists(), f"the two-process run of {other} failed:\n{err.read_text()[-3000:]}"
    with open(two_processes / f"{pair[0]}-{pair[1]}.pkl", "rb") as f:
        res = Result(**pickle.load(f))
    check_pair(spec, res)


def _mp_main(coordinator: str, num_processes: str, process_id: str, local: str, out: str, *names: str) -> None:
    """``python tests/test_pairs.py mp COORDINATOR N ID LOCAL_DEVICES OUT_DIR PAIR...``: join the job,
    run :func:`execute` of each pair's other feature on the global mesh; process 0 writes the results."""
    import pickle

    from jaxpar.devices import initialize

    initialize(coordinator, int(num_processes), int(process_id), local_device_count=int(local),
               heartbeat_timeout=30, initialization_timeout=120)
    import jax

    for name in names:
        spec = build(tuple(c for c in name.split("-") if c != "MP"))
        try:
            res = execute(spec, mesh=jaxpar.make_mesh(spec.sizes))
        except Exception:        # noqa: BLE001 - the test reports it; the next pairs still run
            import traceback

            if jax.process_index() == 0:
                (Path(out) / f"{name}.err").write_text(traceback.format_exc())
            print(f"failed {name}", flush=True)
            continue
        if jax.process_index() == 0:
            with open(Path(out) / f"{name}.pkl", "wb") as f:
                pickle.dump(dataclasses.asdict(res), f)
        print(f"done {name}", flush=True)
    print("OK", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["mp"]:
        _mp_main(*sys.argv[2:])
