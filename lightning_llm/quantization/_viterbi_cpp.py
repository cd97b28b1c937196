r"""Compiled CPU Viterbi for the bitshift trellis: the same codes as :func:`.trellis._viterbi_core`, faster.

:func:`viterbi_cpp` runs the whole constrained Viterbi of :mod:`.trellis` (forward pass, final argmin,
traceback) for every tile in one C++ call: tiles are independent and run in an ``at::parallel_for`` over tiles
(``torch.get_num_threads()`` threads), each with its own ``2^L`` cost arrays (16 KiB at ``L = 12``, 256 KiB at
``L = 16``) and ``N·2^{L−kV}`` bytes of back-pointers, so there is no chunking and no Python loop over tiles or
steps. States are int32 inside; the result is int64 like the reference's.

It reproduces the torch reference bit for bit (``tests/quantization/test_trellis.py`` checks states and costs
on odd shapes): the branch costs are formed as the reference's ``addcmul`` forms them, ``fma(d_1, d_1,
fma(d_0, d_0, prev))`` with ``d_v = c_v(s) − x_v`` (torch's CPU ``addcmul`` rounds ``prev + d·d`` once; the
first step is ``d_0·d_0`` rounded, as ``square_``), compiled with ``-ffp-contract=off`` so that nothing else is
fused; the minimum over
the ``2^kV`` predecessors is the reference's halving tournament (``h`` paired with ``h + H/2``, the upper one
kept only if strictly smaller); the final state is the lowest-index minimum, as ``Tensor.min(dim)``.

The extension is built on first use with :func:`torch.utils.cpp_extension.load_inline` (a C++ compiler and
ninja are needed; about a minute once, then cached in torch's extension directory). :func:`available` builds it
if needed and says whether that worked; :func:`.trellis.viterbi` falls back to the torch reference (with one
warning) when it did not.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

__all__ = ["available", "viterbi_cpp"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

// One tile's constrained Viterbi. H = 2^kV is a template constant so that the inner loops vectorise.
template <int KV>
static float tile_viterbi(const float* x, int64_t N, int64_t V, const float* C, int L, bool use_start,
                          int32_t start_high, bool use_end, int32_t end_low, float* c, float* w, int32_t* ix,
                          uint8_t* back, int64_t* out) {
  constexpr int32_t H = 1 << KV;
  const int32_t S = 1 << L, U = 1 << (L - KV);
  const float INF = std::numeric_limits<float>::infinity();
  // step 0: c(s) = d_0^2 (+ d_1^2)
  {
    const float x0 = x[0];
    for (int32_t s = 0; s < S; ++s) {
      const float d = C[s] - x0;
      c[s] = d * d;
    }
    for (int64_t v = 1; v < V; ++v) {
      const float xv = x[v];
      const float* Cv = C + v * S;
      for (int32_t s = 0; s < S; ++s) {
        const float d = Cv[s] - xv;
        c[s] = std::fma(d, d, c[s]);
      }
    }
    if (use_start)
      for (int32_t s = 0; s < S; ++s)
        if ((s >> KV) != start_high) c[s] = INF;
  }
  for (int64_t t = 1; t < N; ++t) {
    // min over predecessors h of c[h*U + u]: halving tournament, the upper one kept only if strictly smaller.
    constexpr int32_t half0 = H / 2;
    for (int32_t i = 0; i < half0; ++i) {
      const float* lo = c + (int64_t)i * U;
      const float* hi = c + (int64_t)(i + half0) * U;
      float* wo = w + (int64_t)i * U;
      int32_t* io = ix + (int64_t)i * U;
      for (int32_t u = 0; u < U; ++u) {
        const float a = lo[u], b = hi[u];
        const bool take = b < a;
        wo[u] = take ? b : a;
        io[u] = take ? i + half0 : i;
      }
    }
    for (int32_t h = half0; h > 1; h /= 2) {
      const int32_t half = h / 2;
      for (int32_t i = 0; i < half; ++i) {
        float* lo = w + (int64_t)i * U;
        const float* hi = w + (int64_t)(i + half) * U;
        int32_t* ilo = ix + (int64_t)i * U;
        const int32_t* ihi = ix + (int64_t)(i + half) * U;
        for (int32_t u = 0; u < U; ++u) {
          const float a = lo[u], b = hi[u];
          const bool take = b < a;
          lo[u] = take ? b : a;
          ilo[u] = take ? ihi[u] : ilo[u];
        }
      }
    }
    uint8_t* bt = back + t * U;
    for (int32_t u = 0; u < U; ++u) bt[u] = (uint8_t)ix[u];
    // new cost of s' = u*H + b: fma(d_0, d_0, min[u]) (then fma(d_1, d_1, .)), as torch's addcmul computes it
    const float* xt = x + t * V;
    const float x0 = xt[0];
    for (int32_t u = 0; u < U; ++u) {
      const float m = w[u];
      const float* Cu = C + (int64_t)u * H;
      float* cu = c + (int64_t)u * H;
#pragma GCC unroll 16
      for (int32_t b = 0; b < H; ++b) {
        const float d = Cu[b] - x0;
        cu[b] = std::fma(d, d, m);
      }
    }
    for (int64_t v = 1; v < V; ++v) {
      const float xv = xt[v];
      const float* Cv = C + v * S;
      for (int32_t s = 0; s < S; ++s) {
        const float d = Cv[s] - xv;
        c[s] = std::fma(d, d, c[s]);
      }
    }
  }
  if (use_end)
    for (int32_t s = 0; s < S; ++s)
      if ((s & (U - 1)) != end_low) c[s] = INF;
  int32_t s = 0;  // lowest-index minimum, as Tensor.min(dim)
  float best = c[0];
  for (int32_t q = 1; q < S; ++q)
    if (c[q] < best) {
      best = c[q];
      s = q;
    }
  out[N - 1] = s;
  for (int64_t t = N - 1; t > 0; --t) {
    const int32_t u = s >> KV;
    s = ((int32_t)back[t * U + u] << (L - KV)) | u;
    out[t - 1] = s;
  }
  return best;
}

using TileFn = float (*)(const float*, int64_t, int64_t, const float*, int, bool, int32_t, bool, int32_t, float*,
                         float*, int32_t*, uint8_t*, int64_t*);

// xs [T, N, V] float32, tbl [V, S] float32, start_high / end_low [T] int64 (ignored when use_* is false).
// Returns (states [T, N] int64, best cost [T] float32).
std::vector<torch::Tensor> viterbi_tiles(torch::Tensor xs, torch::Tensor tbl, int64_t L, int64_t kv,
                                         torch::Tensor start_high, bool use_start, torch::Tensor end_low,
                                         bool use_end) {
  TORCH_CHECK(xs.dim() == 3 && xs.scalar_type() == torch::kFloat32 && xs.is_contiguous(), "xs: [T, N, V] f32");
  TORCH_CHECK(tbl.dim() == 2 && tbl.scalar_type() == torch::kFloat32 && tbl.is_contiguous(), "tbl: [V, S] f32");
  TORCH_CHECK(kv >= 1 && kv <= 8 && L > kv && L <= 24, "need 1 <= kV <= 8 and kV < L <= 24");
  const int64_t T = xs.size(0), N = xs.size(1), V = xs.size(2);
  const int32_t S = 1 << L, U = 1 << (L - kv);
  TORCH_CHECK(tbl.size(0) == V && tbl.size(1) == S, "tbl must be [V, 2^L]");
  TORCH_CHECK(N >= 1, "no steps");
  static const TileFn fns[8] = {tile_viterbi<1>, tile_viterbi<2>, tile_viterbi<3>, tile_viterbi<4>,
                                tile_viterbi<5>, tile_viterbi<6>, tile_viterbi<7>, tile_viterbi<8>};
  const TileFn fn = fns[kv - 1];
  auto states = torch::empty({T, N}, torch::kInt64);
  auto best = torch::empty({T}, torch::kFloat32);
  auto sh = start_high.to(torch::kInt64).contiguous();
  auto el = end_low.to(torch::kInt64).contiguous();
  const float* X = xs.data_ptr<float>();
  const float* C = tbl.data_ptr<float>();
  const int64_t* SH = sh.data_ptr<int64_t>();
  const int64_t* EL = el.data_ptr<int64_t>();
  int64_t* ST = states.data_ptr<int64_t>();
  float* BEST = best.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cost(S), work(S);
    std::vector<int32_t> idx(S);
    std::vector<uint8_t> back((size_t)N * U);
    for (int64_t tile = begin; tile < end; ++tile)
      BEST[tile] = fn(X + tile * N * V, N, V, C, (int)L, use_start, use_start ? (int32_t)SH[tile] : 0, use_end,
                      use_end ? (int32_t)EL[tile] : 0, cost.data(), work.data(), idx.data(), back.data(),
                      ST + tile * N);
  });
  return {states, best};
}
"""

_module = None
_failed = False


def _load():
    global _module, _failed
    if _module is None and not _failed:
        try:
            from torch.utils.cpp_extension import load_inline

            # -mavx2 only where torch itself detected AVX2 (the build is cached under a name per ISA level).
            isa = torch.backends.cpu.get_cpu_capability()
            simd = ["-mavx2", "-mfma"] if isa in ("AVX2", "AVX512") else []
            _module = load_inline(
                name=f"lightning_llm_viterbi_v3_{isa.lower()}",
                cpp_sources=_SOURCE,
                functions=["viterbi_tiles"],
                extra_cflags=["-O3", "-ffp-contract=off", *simd],
                verbose=False,
            )
        except Exception as e:  # no compiler / ninja / headers: the torch reference still works
            _failed = True
            warnings.warn(
                f"compiled Viterbi unavailable ({type(e).__name__}: {e}); using the torch reference",
                stacklevel=2,
            )
    return _module


def available() -> bool:
    """Whether the compiled Viterbi can run here (builds it on the first call)."""
    return _load() is not None


def viterbi_cpp(
    xs: Tensor, table: Tensor, L: int, kv: int, start_high: Tensor | None, end_low: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Same contract as :func:`.trellis._viterbi_core`: ``xs [T, N, V]`` → ``(states [T, N] int64, cost [T])``."""
    mod = _load()
    if mod is None:
        raise RuntimeError("the compiled Viterbi is unavailable (see the warning raised when building it)")
    if xs.device.type != "cpu":
        raise ValueError(f"the compiled Viterbi runs on CPU tensors, got {xs.device}")
    empty = torch.zeros(0, dtype=torch.int64)
    xs = xs.float().contiguous()
    tbl = table.float().t().contiguous()
    return mod.viterbi_tiles(
        xs,
        tbl,
        L,
        kv,
        start_high if start_high is not None else empty,
        start_high is not None,
        end_low if end_low is not None else empty,
        end_low is not None,
    )
