"""jaxpar against itself in ``levanter.py``'s harness: two jaxpar workers in alternation, the second with
extra logical rules. With no rules both run the identical program, which gives the harness's noise floor;
with ``'[["vocab", null]]'`` it measures what splitting the vocabulary over ``tensor`` is worth.

It needs a checkpoint and tokens that ``levanter.py --keep DIR`` left in ``DIR``.

Usage::

    .venv/bin/python benchmarks/peers/jaxpar_ab.py --from DIR [--rules '[["vocab", null]]'] [--layout FSDP4xTP2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _driver():
    """``levanter.py`` as a module (its name would shadow the package in a plain import)."""
    spec = importlib.util.spec_from_file_location("peer_levanter_driver", os.path.join(HERE, "levanter.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", required=True, help="a levanter.py --keep folder")
    p.add_argument("--rules", type=json.loads, default=[], help="extra rules of the second worker, JSON pairs")
    p.add_argument("--layout", default="FSDP4xTP2")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    d = _driver()
    ckpt, tokens = os.path.join(args.source, "levanter-init"), os.path.join(args.source, "tokens.npy")
    if not (os.path.isdir(ckpt) and os.path.exists(tokens)):
        raise SystemExit(f"--from {args.source}: no levanter-init/ and tokens.npy there; run "
                         f"benchmarks/peers/levanter.py --keep {args.source} first.")
    out = tempfile.mkdtemp(prefix="peer-ab-")
    argv_ = [sys.executable, "-P", os.path.join(HERE, "_jaxpar_worker.py")]
    workers = {"default": d.Worker("default", argv_, os.path.join(out, "default.log")),
               "rules": d.Worker("rules", argv_, os.path.join(out, "rules.log"))}
    try:
        res = {}
        for name, w in workers.items():
            w("init", model={}, batch=args.batch, seq=args.seq, tokens=tokens, lr=1e-3, weight_decay=1e-4, seed=0)
            res[name] = w("setup", axes=d.LAYOUTS[args.layout][0], hlo=os.path.join(out, f"{name}.hlo.txt"), warmup=3,
                          checkpoint=ckpt, rules=args.rules if name == "rules" else None)
        samples = d.alternate(workers, args.rounds, args.steps)
    finally:
        for w in workers.values():
            w.close()
    r = sorted(a / b for a, b in zip(samples["rules"], samples["default"]))
    print(f"{args.layout}, rules {args.rules} / default: median {statistics.median(r):.3f} "
          f"(IQR {r[len(r) // 4]:.3f}-{r[(3 * len(r)) // 4]:.3f}); FLOPs {res['rules']['flops'] / res['default']['flops']:.3f}; "
          f"losses {res['default']['losses']} / {res['rules']['losses']}; load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
