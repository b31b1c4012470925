"""Issue 34's multi-row bodies priced by the calibrated model before they exist (docs/kernel-model.md,
"Predicted, calibrated model"): `python -m zlc.kernelmodel.designs` prints the table.

A body that is not written has no SASS, so its loops are priced from what the issue specifies and
the calibrated terms, each assumption stated here:

    16-bit MMA Linear   Triton-pipelined tl.dot on bf16 operands (several stages in flight): a task
                        pays one pipeline fill (a weight tile's first byte from HBM, tile_dram_x x the
                        DRAM range, then kstep_rt dependent L2 round trips), then the later of its
                        weight stream and its MMAs: the stream at the rate the decode fit measured for
                        the matrix-vector bodies (IN_FLIGHT bytes in flight per SM over the DRAM latency
                        under load, dram_x x the range; at most the SM's share of HBM), the MMAs at the
                        spec's dense bf16 rate on 64-row tiles; fewer than 16 rows take the
                        matrix-vector stream (each chunk used by every row, f32 FMAs);
    flash attention     the last 64-row query block over every key: K and V in 16 bits from L2 at the
                        SM's L2 rate or the MMAs, whichever is longer, after one fill;
    batched paged       per task its rows' 16-bit K and V pages streamed like the weights, after the
    decode              page table's round trip and the first byte.

The table structure, the claim rule, the per-task cost and signal -> poll are the calibrated model's
(`multirow`), so what these figures change is the bodies only.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from .calibration import load
from .latency import params_for
from .multirow import (
    MMA_FLOPS_PER_CLK,
    BodyFacts,
    ModelShape,
    MultiRowTerms,
    Priced,
    Pricer,
    batch_step,
    prefill,
)

__all__ = ["IN_FLIGHT", "Issue34", "table"]

IN_FLIGHT = 32768  # bytes in flight per SM in the weight stream: the decode bodies' 32-56 KB, low end
MMA_ROWS = 64


class Issue34(Pricer):
    """The bodies issue 34 asks for (see the module docstring)."""

    def _rate(self) -> float:  # bytes per µs one SM streams from HBM
        lp = self.lp
        return min(IN_FLIGHT / lp.dram_us, lp.sm_gbs * 1e3, lp.hbm_gbs * 1e3 / lp.sms)

    def _body(self, nbytes: float, flops: float, l2: bool = False, what: str = "weight stream") -> Priced:
        lp = self.lp
        fill = (lp.l2_us if l2 else self.dram_us) + self.t.kstep_rt * lp.l2_us
        stream = nbytes / (lp.sm_gbs * 1e3 if l2 else self._rate())
        mma = flops / (MMA_FLOPS_PER_CLK[self.fam]["bf16"] * lp.clock_ghz * 1e3)
        parts = {"pipeline fill": fill, what: stream if stream >= mma else 0.0, "mma": mma if mma > stream else 0.0}
        return Priced(sum(parts.values()), parts)

    def linear(self, rows: int, k: int, n: int, gated: bool, normed: bool) -> Priced:
        mats = 2 if gated else 1
        padded = rows if rows < 16 else math.ceil(rows / MMA_ROWS) * MMA_ROWS
        if rows < 16:  # CUDA-core FMAs: 2 flops per lane per cycle, 128 lanes; priced as MMA-rate work x 1/8
            flops = 2.0 * rows * n * k * mats * MMA_FLOPS_PER_CLK[self.fam]["bf16"] / 256.0
        else:
            flops = 2.0 * padded * n * k * mats
        p = self._body(n * k * 2.0 * mats, flops)
        if normed:  # the rows' RMS from L2 before the stream
            p.add(Priced(self.lp.l2_us + rows * k * 4.0 / (self.lp.sm_gbs * 1e3),
                         {"norm pass": self.lp.l2_us + rows * k * 4.0 / (self.lp.sm_gbs * 1e3)}))
        return p

    def attention_prefill(self, t_rows: int) -> Priced:
        hd = 64
        return self._body(t_rows * hd * 2.0 * 2, 4.0 * MMA_ROWS * t_rows * hd, l2=True, what="KV stream (L2)")

    def attention_paged(self, rows: int, context: int) -> Priced:
        """The step's (row, KV head) pairs spread over the grid: a task streams its share of them
        (`shares`, set by the caller: rows x KV heads / SMs, at least one)."""
        hd, n = 64, max(1, math.ceil(self.shares))
        p = Priced(self.lp.l2_us, {"page table": self.lp.l2_us})
        p.add(self._body(n * (context + 1) * hd * 2.0 * 2, 4.0 * 16 * n * (context + 1) * hd, what="KV stream"))
        return p

    shares = 1.0


# the 1-row decode steps the batch aims compare with: the calibrated decode model at context 512
# (docs/performance.md, "The calibrated model"; python bench/kernel_stats.py --markdown)
DECODE_512 = {("smollm2-135m", "h200"): 949.3, ("smollm2-135m", "a10"): 1710.6,
              ("llama-1b-shape", "h200"): 2550.6, ("llama-1b-shape", "a10"): 6381.4}
AIM_TTFT_MS = {"smollm2-135m": 2.4, "llama-1b-shape": 2.2}


def _shared(pricer: type[Pricer] | None, shares: float) -> type[Pricer] | None:
    if pricer is None:
        return None
    return type(pricer.__name__, (pricer,), {"shares": shares})


def table(context: int = 512) -> str:
    data = load()
    mr = data["multirow"]
    terms = MultiRowTerms(**mr["fit"]["terms"])
    facts = BodyFacts.from_dict(mr["sass"]["16x32x32"])
    lines = ["| predicted, calibrated model | target | TTFT-128 ms (aim) | 16-row step µs (x 1-row; aim 1.3x) "
             "| 64-row step µs (x 1-row; aim 2x) | limiting term (TTFT / 16 / 64) |", "|---|---|---|---|---|---|"]
    for model in ("smollm2-135m", "llama-1b-shape"):
        shape = ModelShape(**mr["models"][model])
        for target in ("h200", "a10"):
            lp0, raw = params_for(target, "central"), params_for(target, "central", calibrated=False).dram_us
            one = DECODE_512[(model, target)]
            for name, pricer, cut in (("today's bodies (tf32x3, 16x32x32)", None, False),
                                      ("issue 34 bodies (16-bit MMA, pipelined)", Issue34, False),
                                      ("issue 34 bodies + issue 35's cut (no per-task cost, no signal wait)", Issue34, True)):
                lp = replace(lp0, task_us=0.0, sync_us=0.0) if cut else lp0
                ttft = prefill(shape, facts, lp, terms, raw, 128, pricer=pricer)
                b16, b64 = (batch_step(shape, facts, lp, terms, raw, b, context,
                                       pricer=_shared(pricer, b * shape.kv_heads / lp.sms)) for b in (16, 64))
                lines.append(f"| {model} {name} | {target} | {ttft.us / 1e3:,.1f} ({AIM_TTFT_MS[model]}) | "
                             f"{b16.us:,.0f} ({b16.us / one:.1f}x) | {b64.us:,.0f} ({b64.us / one:.1f}x) | "
                             f"{ttft.limit} / {b16.limit} / {b64.limit} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zlc.kernelmodel.designs", description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=512, help="each batched row's context (tokens)")
    a = ap.parse_args(argv)
    print(table(a.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
