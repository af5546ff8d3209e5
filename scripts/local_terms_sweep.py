"""Which same-host message terms (the cost model's ``local`` link) pick best on measured points.

Takes the points of a calibration (``python -m torchdist_ext.bench calibrate --dry-run
--json fit.json``), keeps every other link at this process's model, and for each
candidate (alpha, beta, gamma) of ``local`` counts the op/sizes where the algorithm the
model would pick ran more than 10% slower than the fastest measured one.

    .venv/bin/python scripts/local_terms_sweep.py fit.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torchdist_ext


def predict(terms: dict[str, float], p: dict) -> float:
    return terms["alpha"] * p["steps"] + terms["beta"] * p["bytes_moved"] + \
        terms["gamma"] * p["bytes_reduced"]


def losses(points: list[dict], model: dict[str, dict[str, float]],
           tolerance: float) -> list[tuple[str, int, str, str, float]]:
    """(op, size, picked, fastest, loss) wherever the pick lost by more than ``tolerance``."""
    out = []
    for op, size in sorted({(p["op"], p["size"]) for p in points}):
        mine = [p for p in points if p["op"] == op and p["size"] == size]
        pick = min(mine, key=lambda p: predict(model[p["link"]], p))
        best = min(mine, key=lambda p: p["measured_s"])
        loss = pick["measured_s"] / best["measured_s"] - 1.0
        if loss > tolerance:
            out.append((op, size, pick["algo"], best["algo"], loss))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fit", help="calibrate --json output")
    ap.add_argument("--alpha-us", default="10,20,30")
    ap.add_argument("--beta-gbs", default="1.5,3,5,8")
    ap.add_argument("--gamma-gbs", default="1.5,3,6")
    ap.add_argument("--tolerance", type=float, default=0.10)
    a = ap.parse_args()
    points = json.load(open(a.fit))["points"]
    # Points fitted as net (older fits, before same-host messages had a link) count as local.
    for p in points:
        if p["link"] == "net":
            p["link"] = "local"
    base = torchdist_ext.cost_model()

    def grid(text: str) -> list[float]:
        return [float(x) for x in text.split(",")]

    for alpha, beta, gamma in itertools.product(grid(a.alpha_us), grid(a.beta_gbs),
                                                grid(a.gamma_gbs)):
        model = dict(base)
        model["local"] = {"alpha": alpha * 1e-6, "beta": 1 / (beta * 1e9),
                          "gamma": 1 / (gamma * 1e9)}
        bad = losses(points, model, a.tolerance)
        worst = ", ".join(f"{op} {size} {pick}<{best} +{loss * 100:.0f}%"
                          for op, size, pick, best, loss in bad[:6])
        print(f"local alpha {alpha:g} us, beta 1/{beta:g} GB/s, gamma 1/{gamma:g} GB/s: "
              f"{len(bad)} losses  {worst}{' ...' if len(bad) > 6 else ''}")


if __name__ == "__main__":
    main()
