"""The source of the specialized matrix-vector bodies (one `@triton.jit` function per `gemv_plan.GemvBody`)
and of the dispatch chain in `_linear_gemv` that picks one; the template places both.

gemv_plan.py plans the bodies (which K, norm, gate, chunks, depth); this writes them out. What depends
on a body's shape (K, the norm kind, the gate, the chunks, the fused down, the literal act / lm /
copy) is decided here, in Python: those are literals by design. What depends on the model's
features (a bias, the LM head's soft-cap, the fused MLP down's accumulator) is written as an
`if HAS_<FEATURE>:` on the kernel's constexpr flags (emit.Features.flags), which Triton folds.

The pieces return their statements without the body's indentation (`_indent` adds it), so a
chunk's statements serve both the unrolled body and the wide body's rolled loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .program import NORM_COMBINE, NORM_LAYER, NORM_NONE, NORM_RMS

if TYPE_CHECKING:
    from .gemv_plan import Chunk, GemvBody

_WHAT = {NORM_NONE: "W @ x", NORM_RMS: "rstd * (W @ (g * x)): RMSNorm folded into the product",
         NORM_LAYER: "W @ LayerNorm(x) in one pass (chunk statistics merged as they come)",
         NORM_COMBINE: "W @ x, x merged from split-KV attention partials as it loads"}


def _indent(lines: Iterable[str], n: int = 4) -> list[str]:
    return [" " * n + line for line in lines]


def _normed(g: GemvBody) -> bool:
    """RMSNorm or LayerNorm: the body loads norm gains (g_i) beside the weights."""
    return g.norm in (NORM_RMS, NORM_LAYER)


def _if_flag(flag: str, then: list[str], otherwise: list[str]) -> list[str]:
    """A feature's two versions of some statements, for Triton to fold on the constexpr `flag`."""
    return [f"if {flag}:", *_indent(then), "else:", *_indent(otherwise)]


# ---- the function ------------------------------------------------------------------------------

def body(g: GemvBody) -> str:
    """The whole `@triton.jit` function of `g`, ending in a newline."""
    lines = [*_descriptor(g), *_prologue(g), *_after_wait(g)]
    lines += _rolled_stream(g) if g.wide else _unrolled_stream(g)
    lines += [*_rstd(g), *_epilogue(g), *_fused_down(g)]
    return "\n".join(_header(g) + _indent(lines)) + "\n"


def _header(g: GemvBody) -> list[str]:
    gate = ", with a gate (two matrices)" if g.gated else ""
    lm_own = f", the LM head's own: {g.wide}" if g.wide else ""
    if g.wide:
        rows = [f"# for row r of x and rows of K = {g.k}, in a rolled loop over {len(g.chunks)} chunks of "
                f"{g.chunks[0].size} columns (the LM",
                "# head's wide block: unrolled, its many small chunks' loads were hoisted and spilled): "
                "no masks along K,"]
    else:
        rows = [f"# for row r of x and rows of K = {g.k}, unrolled in chunks of "
                f"{' + '.join(str(c.size) for c in g.chunks)} columns: no masks along K,"]
    doc = [
        f"# y[n0:n1] = {_WHAT[g.norm]}{gate},",
        *rows,
        f"# 128-bit weight loads, {g.depth} chunk(s) in flight per stream ({g.inflight_kb} KB of weights "
        "per program at",
        f"# BLOCK_N {g.block_n}). The first weights{' and norm gains' if _normed(g) else ''} are requested "
        "BEFORE the task waits for",
        f"# its input -- weights never depend on the step -- and each chunk requests the one {g.depth} ahead",
        "# before its arithmetic, so the weight stream never waits for the math. One block of columns per",
        f"# task (the dispatch checks n1 - n0 <= BLOCK_N{lm_own}).",
    ]
    if g.down:
        doc.append(f"# Then the MLP's down, fused (split-K): its {g.down} outputs += Wd[:, n0:n1] @ y (below).")
    doc += [
        "#",
        "# The descriptor (op_linear's fields) is read here so that the alignment facts Triton cannot see",
        "# attach to the loads that define them (a hint on a function argument is lost): pack.py places",
        "# W at multiples of 64 elements, A and P at multiples of 16, and row r of x starts at r * K.",
        "# Without them the row's loads stay scalar, and their layout spreads to the weights'.",
    ]
    return ["@triton.jit",
            f"def {g.name}(DI, DF, CNT, CTRL, row, W, P, A, d, r, n0, n1, slot, BLOCK_N: tl.constexpr, "
            "KV_SPLITS: tl.constexpr,",
            " " * 10 + "DEBUG: tl.constexpr):",
            *_indent(doc)]


def _descriptor(g: GemvBody) -> list[str]:
    """The descriptor words the body reads (shape-time literals where every task of the shape agrees),
    the block's columns and the base pointers and column ranges of its streams."""
    out = ["di = DI + d * DESC_WORDS"]
    if g.norm == NORM_COMBINE:
        out.append("xrow = tl.load(di + DI_LINEAR_X_OFF)  # the split-KV partials (decode: one row)")
    else:
        out.append(f"xrow = tl.multiple_of(tl.load(di + DI_LINEAR_X_OFF) + r * {g.k}, 16)")
    out.append("w_off = tl.multiple_of(tl.load(di + DI_LINEAR_W), 64)")
    if g.gated:
        out.append("w2_off = tl.multiple_of(tl.load(di + DI_LINEAR_W2), 64)")
    out += ["b_off = tl.load(di + DI_LINEAR_BIAS)",
            "res_off = tl.load(di + DI_LINEAR_RES_OFF)",
            "out_stride = tl.load(di + DI_LINEAR_OUT_STRIDE)",
            'res_off = tl.where(res_off >= 0, res_off + r * out_stride, res_off)  # -1 stays "no residual"',
            "out_off = tl.load(di + DI_LINEAR_OUT_OFF) + r * out_stride"]
    if _normed(g):
        out += ["nw = tl.multiple_of(tl.load(di + DI_LINEAR_NORM_W), 16)",
                "eps = tl.load(DF + d * DESC_FLOATS + DF_LINEAR_EPS)"]
    if g.ln_bias:
        out.append("nb = tl.multiple_of(tl.load(di + DI_LINEAR_NORM_B), 16)")
    if g.act >= 0:
        out.append(f"act = {g.act}  # every task of this shape has it: a literal compiles out the other code "
                   "and frees a register")
    else:
        out.append("act = tl.load(di + DI_LINEAR_ACT)")
    if g.lm >= 0:
        why = "no task of this shape is an LM head" if g.lm == 0 else "LM-head tasks only"
        out.append(f"lm = {g.lm}  # {why}")
    else:
        out.append("lm = tl.load(di + DI_LINEAR_LM)")
    out += ["part = tl.load(di + DI_LINEAR_LM_PARTIALS)",
            "cols = n0 + tl.arange(0, BLOCK_N)",
            "cmask = cols < n1",
            f"wbase = W + w_off + cols[:, None].to(tl.int64) * {g.k}"]
    if g.down:
        out += ["dbase = W + tl.multiple_of(tl.load(di + DI_LINEAR_DOWN_W) + n0, 8)  "
                "# Wd[:, n0:n1]: a row's slice is contiguous",
                "dout = tl.load(di + DI_LINEAR_DOWN_OUT)",
                "# the rows (always all of them): a mask along rows keeps the loads 128-bit, like the gate/up",
                "# weights' (a mask along the columns would make them scalar)",
                "drows = tl.load(di + DI_LINEAR_DOWN_ROWS)",
                "kd = tl.arange(0, BLOCK_N)"]
        out += [f"rd{s} = tl.arange(0, {s})" for s in g.down_distinct_sizes]
    if g.gated:
        out.append(f"vbase = W + w2_off + cols[:, None].to(tl.int64) * {g.k}")
    out += [f"ks{s} = tl.arange(0, {s})" for s in g.distinct_sizes]
    return out


def _prologue(g: GemvBody) -> list[str]:
    """Before the wait: the first chunks' weights (and gains), the fused down's first chunks where
    the gate/up stream is requested whole here, and the epilogue's static inputs."""
    out = [line for c in g.chunks[:g.depth] for line in load_weights(g, c.i, c.lo, c.size)]
    out += [line for j in (g.down_issue[0] if g.down else ()) for line in load_down(g, g.down_chunks[j])]
    out.append("# the epilogue's static inputs (never written in a launch) before the wait, too")
    out += _if_flag("HAS_LM_SOFTCAP", ["cap = tl.load(DF + d * DESC_FLOATS + DF_LINEAR_SOFTCAP)"], ["cap = 0.0"])
    out += _if_flag("HAS_BIAS", ["bias = tl.load(P + b_off + cols, mask=cmask & (cols * 0 + b_off >= 0), other=0.0)"],
                    ["bias = 0.0"])
    none = ["copy = 0", "copy_off = 0"]
    if g.copy == 0:  # no task of the shape initializes an accumulator
        return out + none
    copy = ["# 1: the output also initializes a fused MLP down's accumulator (at copy_off)",
            f"copy = {g.copy if g.copy > 0 else 'tl.load(di + DI_LINEAR_COPY)'}",
            "copy_off = tl.load(di + DI_LINEAR_COPY_OFF) + r * out_stride"]
    return out + _if_flag("HAS_MLP_SPLIT_K", copy, none)


def _after_wait(g: GemvBody) -> list[str]:
    """The wait, the first chunks' rows of x, the residual and the accumulators."""
    out = ["_wait_deps(CNT, CTRL, row, DEBUG)"]
    out += [line for c in g.chunks[:g.depth] for line in load_row(g, c.i, c.lo, c.size)]
    out += ['res = tl.load(A + res_off + cols, mask=cmask & (cols * 0 + res_off >= 0), other=0.0, '
            'cache_modifier=".cg")',
            "acc = tl.zeros([BLOCK_N], dtype=tl.float32)",
            "acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)" if g.gated else "acc2 = acc"]
    if g.norm == NORM_RMS:
        out += ["# the squares summed elementwise, one vector per chunk size, and reduced once after the last",
                "# chunk: a reduction per chunk crossed the warps (two BAR.SYNC) every chunk"]
        out += [f"ss{s} = tl.zeros([{s}], dtype=tl.float32)" for s in g.chunk_sizes]
    elif g.norm == NORM_LAYER:
        out += ["mean = tl.zeros([], dtype=tl.float32)",
                "m2 = tl.zeros([], dtype=tl.float32)",
                "accg = tl.zeros([BLOCK_N], dtype=tl.float32)  # W @ g, for the mean term"]
        if g.gated:
            out.append("accg2 = tl.zeros([BLOCK_N], dtype=tl.float32)")
        if g.ln_bias:
            out.append("accb = tl.zeros([BLOCK_N], dtype=tl.float32)  # W @ b")
            if g.gated:
                out.append("accb2 = tl.zeros([BLOCK_N], dtype=tl.float32)")
    return out


# ---- a chunk -------------------------------------------------------------------------------------
# `i` names the chunk's values (w_i, x_i, ...); `lo` is its first column, a number or, in the
# rolled loop, an expression of k0.

def load_weights(g: GemvBody, i: int, lo: int | str, size: int) -> list[str]:
    """Chunk i's weights (both matrices of a gate) and norm gains."""
    cols = f"({lo} + ks{size})[None, :]"
    out = [f"w_{i} = tl.load(wbase + {cols}, mask=cmask[:, None], other=0.0)"]
    if g.gated:
        out.append(f"v_{i} = tl.load(vbase + {cols}, mask=cmask[:, None], other=0.0)")
    if _normed(g):
        out.append(f"g_{i} = tl.load(P + nw + {lo} + ks{size})")
    return out


def load_row(g: GemvBody, i: int, lo: int | str, size: int) -> list[str]:
    """Chunk i's columns of the row x (merged from the split-KV partials, NORM_COMBINE)."""
    if g.norm == NORM_COMBINE:
        return [f"x_{i} = _merged_x(A, xrow, {lo} + ks{size}, {g.head_d}, KV_SPLITS)"]
    return [f'x_{i} = tl.load(A + xrow + {lo} + ks{size}, cache_modifier=".cg")']


def load_down(g: GemvBody, c: Chunk) -> list[str]:
    """The fused down's chunk c: rows [c.lo, c.lo + c.size) of Wd[:, n0:n1], masked along the columns
    only where the gate/up's N leaves a partial block."""
    rows = f"{c.lo} + rd{c.size}"
    mask = f"({rows} < drows)[:, None]" + ("" if g.down_ld % g.block_n == 0 else " & cmask[None, :]")
    return [f"wd_{c.i} = tl.load(dbase + ({rows})[:, None] * {g.down_ld} + kd[None, :], mask={mask}, other=0.0)"]


def chunk_math(g: GemvBody, i: int, size: int, lo: int | str, mean_w: float | str, m2_w: float | str) -> list[str]:
    """Chunk i's products into the accumulators, with its norm statistics (LayerNorm: the chunk's
    (mean, M2) merged into the running ones with weights mean_w and m2_w, Chunk's)."""
    out = [f"wf = w_{i}.to(tl.float32)"]
    if g.gated:
        out.append(f"vf = v_{i}.to(tl.float32)")
    if g.norm in (NORM_NONE, NORM_COMBINE):
        out.append(f"xs = x_{i}")
    elif g.norm == NORM_RMS:
        out += [f"ss{size} += x_{i} * x_{i}", f"xs = x_{i} * g_{i}"]
    else:
        out += [f"mi = tl.sum(x_{i}, 0) / {size}",
                f"dx = x_{i} - mi",
                "delta = mi - mean  # Chan et al.: merge this chunk's (mean, M2) into the running ones",
                f"mean += delta * {mean_w}",
                f"m2 += tl.sum(dx * dx, 0) + delta * delta * {m2_w}",
                f"xs = x_{i} * g_{i}",
                f"accg += tl.sum(wf * g_{i}[None, :], 1)"]
        if g.gated:
            out.append(f"accg2 += tl.sum(vf * g_{i}[None, :], 1)")
        if g.ln_bias:
            out += [f"bk = tl.load(P + nb + {lo} + ks{size})", "accb += tl.sum(wf * bk[None, :], 1)"]
            if g.gated:
                out.append("accb2 += tl.sum(vf * bk[None, :], 1)")
    out.append("acc += tl.sum(wf * xs[None, :], 1)")
    if g.gated:
        out.append("acc2 += tl.sum(vf * xs[None, :], 1)")
    return out


# ---- the stream ----------------------------------------------------------------------------------

def _unrolled_stream(g: GemvBody) -> list[str]:
    """Chunk by chunk: request the chunk `depth` ahead (and the fused down's chunks due here), then
    this chunk's arithmetic."""
    out = []
    for c in g.chunks:
        if c.i + g.depth < len(g.chunks):
            n = g.chunks[c.i + g.depth]
            out += load_weights(g, n.i, n.lo, n.size) + load_row(g, n.i, n.lo, n.size)
        out += [line for j in (g.down_issue[c.i + 1] if g.down else ()) for line in load_down(g, g.down_chunks[j])]
        out += chunk_math(g, c.i, c.size, c.lo, c.mean_w, c.m2_w)
    return out


def _rolled_stream(g: GemvBody) -> list[str]:
    """The LM head's wide body: equal chunks in a loop that requests chunk `depth` ahead into w_depth,
    does chunk 0's arithmetic and shifts the chunks in flight down one; then the last `depth` chunks."""
    cs, d = g.chunks[0].size, g.depth
    ahead = f"k0 + {d * cs}"
    loop = [*load_weights(g, d, ahead, cs), *load_row(g, d, ahead, cs),
            *chunk_math(g, 0, cs, "k0", f"{cs}.0 / (k0 + {cs}.0)", f"k0 * {cs}.0 / (k0 + {cs}.0)")]
    for v in ["w", "x"] + (["g"] if _normed(g) else []):
        loop.append(f"{', '.join(f'{v}_{j}' for j in range(d))} = {', '.join(f'{v}_{j + 1}' for j in range(d))}")
    out = [f"# chunk k0 / {cs}: requests the one {d} ahead, then its arithmetic; the chunks in flight are carried",
           f"for k0 in range(0, {g.k - d * cs}, {cs}):", *_indent(loop)]
    for i, c in enumerate(g.chunks[len(g.chunks) - d:]):
        out += chunk_math(g, i, c.size, c.lo, c.mean_w, c.m2_w)
    return out


# ---- after the stream ----------------------------------------------------------------------------

def _rstd(g: GemvBody) -> list[str]:
    """The norm's statistics applied to the accumulated products."""
    if g.norm == NORM_RMS:
        out = [f"ss = {' + '.join(f'tl.sum(ss{s}, 0)' for s in g.chunk_sizes)}",
               f"rstd = 1.0 / tl.sqrt(ss / {g.k} + eps)",
               "acc = acc * rstd"]
        return out + (["acc2 = acc2 * rstd"] if g.gated else [])
    if g.norm == NORM_LAYER:
        out = [f"rstd = 1.0 / tl.sqrt(m2 / {g.k} + eps)",
               f"acc = rstd * (acc - mean * accg){' + accb' if g.ln_bias else ''}"]
        return out + ([f"acc2 = rstd * (acc2 - mean * accg2){' + accb2' if g.ln_bias else ''}"] if g.gated else [])
    return []


def _epilogue(g: GemvBody) -> list[str]:
    """Bias, activation, gate, residual, store; the LM head's (max, argmax) partial."""
    return [f"best_v, best_i, y = _gemv_store(acc, acc2, bias, res, A, out_off, cols, cmask, act, {g.gated}, lm, "
            "cap, n0,",
            " " * 32 + "tl.zeros([], dtype=tl.float32) + NEG, tl.zeros([], dtype=tl.int32), 1.0, copy,",
            " " * 32 + "copy_off)",
            "if lm != 0:",
            "    tl.store(A + part + slot * 2, best_v)",
            "    tl.store(A + part + slot * 2 + 1, best_i.to(tl.float32))"]


def _fused_down(g: GemvBody) -> list[str]:
    """The MLP's down, fused (split-K): each chunk's partial sums added to dout atomically."""
    if not g.down:
        return []
    out = [f"# The fused MLP down (split-K): dout[0:{g.down}] += Wd[:, n0:n1] @ y by relaxed float atomics, "
           "Wd's",
           f"# rows in chunks of {' + '.join(str(c.size) for c in g.down_chunks)}; their loads continue the "
           f"weight stream ({g.down_depth} chunk(s) ahead,",
           "# the first requested during the last gate/up chunks), so it has no gap.",
           "yd = tl.where(cmask, y, 0.0)",
           "db = tl.load(di + DI_LINEAR_DOWN_BIAS)",
           "for_bias = (db >= 0) & (n0 == 0)  # the task holding column 0 adds the down bias once"]
    for c in g.down_chunks:
        out += [line for j in g.down_issue[len(g.chunks) + c.i + 1] for line in load_down(g, g.down_chunks[j])]
        rows = f"{c.lo} + rd{c.size}"
        out += [f"pd = tl.sum(wd_{c.i}.to(tl.float32) * yd[None, :], 1)",
                "if for_bias:",
                f"    pd += tl.load(P + db + {rows})",
                f'tl.atomic_add(A + dout + {rows}, pd, sem="relaxed")']
    return out


# ---- the dispatch --------------------------------------------------------------------------------

def condition(g: GemvBody, moe_route: bool) -> str:
    """The dispatch's test for a task `g` covers: its K, norm, LayerNorm bias, gate and head size;
    a fused down's rows; the tilings that use it; one block of columns (the LM head's own for a
    wide body). `moe_route`: routed experts take the generic body (`route`, read by _linear_gemv)."""
    terms = ["SPECIALIZED"]
    if moe_route:
        terms.append("(route == 0)")
    terms += [f"(K == {g.k})", f"(norm == {g.norm})",
              "((nb >= 0))" if g.ln_bias else "((nb < 0) | (norm != 2))",
              f"(w2_off {'>=' if g.gated else '<'} 0)"]
    if g.norm == NORM_COMBINE:
        terms.append(f"(nb == {g.head_d})")
    if g.down:
        terms += [f"(down == {g.down})", f"(BLOCK_N == {g.block_n})"]
    elif g.block_n_guard:
        terms.append(f"({g.block_n_guard})")
    if g.wide:
        terms += ["(lm != 0)", "(n1 - n0 > BLOCK_N)", f"(n1 - n0 <= {g.wide})"]
    else:
        terms.append("(n1 - n0 <= BLOCK_N)")
    return " & ".join(terms)


def dispatch(bodies: Sequence[GemvBody], moe_route: bool) -> str:
    """_linear_gemv's chain, up to the generic body's branch (whose statements follow it in the
    template): first, a task whose weights are packed blocks (`wf`, read by the template) takes
    their own body, _linear_q (the specialized bodies read dense weights only); then an `elif` per
    body, then `else:`. No trailing newline. Without HAS_PACKED the template's `wf` is the
    constexpr 0, so Triton folds the packed branch away and compiles the chain from its first body."""
    out = []
    if any(g.wide for g in bodies):
        out += ["# the LM head's wide body takes LM-head tasks only (where a tiling puts several blocks in a",
                "# task, other tasks are as wide)",
                "lm = tl.load(di + DI_LINEAR_LM)"]
    out += ["if wf != 0:",
            "    _linear_q(DI, DF, CNT, CTRL, Q, P, A, row, d, r, n0, n1, slot, BLOCK_N, BLOCK_K, KV_SPLITS, DEBUG, "
            "SPECIALIZED)"]
    # the bodies with a fused down first: a task without one fails their test, so the others need none
    for g in sorted(bodies, key=lambda g: g.down, reverse=True):
        out += [f"elif {condition(g, moe_route)}:",
                f"    {g.name}(DI, DF, CNT, CTRL, row, W, P, A, d, r, n0, n1, slot, {g.wide or 'BLOCK_N'}, "
                "KV_SPLITS, DEBUG)"]
    out.append("else:")
    return "\n".join(_indent(out))
