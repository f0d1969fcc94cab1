// weighted_scatter_add: acc[index[r], :] += float(rows[r, :]) * weight[r]   (fp32 accumulate)
// The un-permutation with weighted combine, and the relay's per-node partial sum of the two-stage combine.
// Also its backward (fused): grad_rows[r, :] = cast(grad_out[index[r], :] * weight[r]),
//                            grad_weight[r] = sum_j grad_out[index[r], j] * rows[r, j]   (fp32).
//
// Element types: fp32, bf16, fp16 (16-bit types are passed as raw uint16 and converted here, so no
// cuda_bf16.h / cuda_fp16.h is needed: bf16 by bit shifts with round-to-nearest-even like torch, fp16 by PTX
// cvt). Index: int32 or int64; indices outside [0, num_out) are skipped (grads of such rows are zero).
// The launcher zero-fills (or copies `base` into) the fp32 accumulator and casts it to the rows' dtype.
//
// Memory traffic (R routes, D hidden, E element bytes, O output rows, I index bytes):
//   forward : reads R*D*E + R*(I+4), R*D fp32 atomic adds into the O*D*4 accumulator (L2 resident when it
//             fits: 16k x 4096 fp32 = 256 MB does not, so ~R*D*4 bytes of atomic traffic),
//             + launcher: zero/copy O*D*4, and for bf16/fp16 a cast pass (read O*D*4, write O*D*E).
//   backward: reads R*D*E (grad_out rows, gathered) + R*D*E (rows, only if grad_weight is needed)
//             + R*(I+4); writes R*D*E (grad_rows) + R*4 (grad_weight).
// With D % 4 == 0 the forward issues one float4 atomic per 4 elements on sm_90+ (4x fewer atomics).
//
// Launch: one warp per route (grid-stride), lanes stride over the row. blockDim.x: multiple of 32.

struct F32 {
    typedef float storage;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float f) { return f; }
};

struct BF16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
    static __device__ __forceinline__ unsigned short store(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;  // NaN, as torch writes it
        u += 0x7fffu + ((u >> 16) & 1u);                                      // round to nearest even
        return (unsigned short)(u >> 16);
    }
};

struct F16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(unsigned short v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ unsigned short store(float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

template <typename E, typename I, bool VEC4>
__device__ __forceinline__ void scatter_add_impl(const typename E::storage* __restrict__ rows,
                                                 const I* __restrict__ index, const float* __restrict__ weight,
                                                 int has_weight, float* __restrict__ acc, long long R,
                                                 long long D, long long num_out) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < R; r += warps) {
        const long long dst = (long long)index[r];
        if (dst < 0 || dst >= num_out) continue;
        const float w = has_weight ? weight[r] : 1.0f;
        const typename E::storage* src = rows + r * D;
        float* out = acc + dst * D;
        if (VEC4) {
            for (long long j = 4 * (long long)lane; j < D; j += 128) {
                const float4 v = make_float4(E::load(src[j]) * w, E::load(src[j + 1]) * w,
                                             E::load(src[j + 2]) * w, E::load(src[j + 3]) * w);
#if __CUDA_ARCH__ >= 900
                // one 16-byte vector reduction (sm_90+); inline PTX, so NVRTC needs no sm_90 atomic headers
                asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(out + j), "f"(v.x), "f"(v.y),
                             "f"(v.z), "f"(v.w)
                             : "memory");
#else
                atomicAdd(out + j, v.x);
                atomicAdd(out + j + 1, v.y);
                atomicAdd(out + j + 2, v.z);
                atomicAdd(out + j + 3, v.w);
#endif
            }
        } else {
            for (long long j = lane; j < D; j += 32) atomicAdd(out + j, E::load(src[j]) * w);
        }
    }
}

template <typename E, typename I>
__device__ __forceinline__ void scatter_add_backward_impl(
    const typename E::storage* __restrict__ grad_out, const typename E::storage* __restrict__ rows,
    const I* __restrict__ index, const float* __restrict__ weight, int has_weight,
    typename E::storage* __restrict__ grad_rows, int want_grad_rows, float* __restrict__ grad_weight,
    int want_grad_weight, long long R, long long D, long long num_out) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < R; r += warps) {
        const long long src = (long long)index[r];
        const bool valid = src >= 0 && src < num_out;
        const float w = has_weight ? weight[r] : 1.0f;
        float dot = 0.0f;
        for (long long j = lane; j < D; j += 32) {
            const float g = valid ? E::load(grad_out[src * D + j]) : 0.0f;
            if (want_grad_rows) grad_rows[r * D + j] = E::store(g * w);
            if (want_grad_weight) dot += g * E::load(rows[r * D + j]);
        }
        if (want_grad_weight) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (lane == 0) grad_weight[r] = dot;
        }
    }
}

#define DS_COBALT_SCATTER(SUFFIX, E, I)                                                                     \
    extern "C" __global__ void weighted_scatter_add_##SUFFIX(const E::storage* rows, const I* index,          \
                                                             const float* weight, int has_weight, float* acc, \
                                                             long long R, long long D, long long num_out) {   \
        scatter_add_impl<E, I, false>(rows, index, weight, has_weight, acc, R, D, num_out);                   \
    }                                                                                                         \
    extern "C" __global__ void weighted_scatter_add_vec4_##SUFFIX(                                            \
        const E::storage* rows, const I* index, const float* weight, int has_weight, float* acc, long long R, \
        long long D, long long num_out) {                                                                     \
        scatter_add_impl<E, I, true>(rows, index, weight, has_weight, acc, R, D, num_out);                    \
    }                                                                                                         \
    extern "C" __global__ void weighted_scatter_add_backward_##SUFFIX(                                        \
        const E::storage* grad_out, const E::storage* rows, const I* index, const float* weight,              \
        int has_weight, E::storage* grad_rows, int want_grad_rows, float* grad_weight, int want_grad_weight,  \
        long long R, long long D, long long num_out) {                                                        \
        scatter_add_backward_impl<E, I>(grad_out, rows, index, weight, has_weight, grad_rows, want_grad_rows, \
                                        grad_weight, want_grad_weight, R, D, num_out);                        \
    }

DS_COBALT_SCATTER(f32_i32, F32, int)
DS_COBALT_SCATTER(f32_i64, F32, long long)
DS_COBALT_SCATTER(bf16_i32, BF16, int)
DS_COBALT_SCATTER(bf16_i64, BF16, long long)
DS_COBALT_SCATTER(f16_i32, F16, int)
DS_COBALT_SCATTER(f16_i64, F16, long long)
