"""bf16 compute with expert parallelism and a data axis trains as exactly as bf16 can.

The MoE GPT of tests/test_moe_train.py (8 experts, top-2, dropless) in bf16 over ``data 2 x expert 4``
(the expert region manual over the whole mesh) and over ``data 2 x expert 2 x tensor 2`` (``tensor``
stays automatic around the expert region, so on CPU its reductions run in fp32: :mod:`jaxpar.parallel._regions`).
The tolerances are those of tests/test_bf16_sequence_parallel.py, derived there: each first-step
gradient leaf at most 2x as far (L2) from the fp32 gradient as the one-device bf16 run's (measured
1.17x and 1.53x, blocks/ln2_bias and lnf_bias), every step's loss within 5e-4 of the one-device bf16
run's (measured 2.6e-5 and 1.2e-5), and the first step's loss equal to the bf16 run on ``expert 4``
alone up to fp32 round-off of the mean, rtol 1e-5 (measured 1.4e-6). Slow (about 35 s): five runs.
"""
from __future__ import annotations

import numpy as np
import pytest

import jaxpar
from jaxpar.models import GPTConfig
from jaxpar.models import MoESettings

from conftest import need_devices
from test_bf16_sequence_parallel import BF16, assert_no_worse_than_one_device, train

MOE = MoESettings(experts=8, top_k=2, capacity_factor=None, aux_weight=0.01, z_weight=1e-3)
CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2, mlp=32, moe=MOE)


@pytest.mark.exhaustive
@need_devices(8)
def test_bf16_expert_parallel_with_data_trains_like_one_device_bf16():
    bf16 = jaxpar.Strategy(**BF16)
    one, fp32 = train({"data": 1}, bf16, cfg=CFG), train({"data": 1}, jaxpar.Strategy(), cfg=CFG)
    alone = train({"expert": 4}, bf16, steps=1, cfg=CFG)
    for sizes in ({"data": 2, "expert": 4}, {"data": 2, "expert": 2, "tensor": 2}):
        run = train(sizes, bf16, cfg=CFG)
        assert_no_worse_than_one_device(run, one, fp32)
        if "tensor" not in sizes:
            np.testing.assert_allclose(run[0][0], alone[0][0], rtol=1e-5)
