// gather_rows: out[p, :] = x[index[p], :]  (permutation of token rows into per-destination send buffers;
// also the backward of nothing else: its own backward is weighted_scatter_add with unit weights).
//
// Rows are copied as raw bytes, so one kernel serves fp32/bf16/fp16 (any dtype): the launcher picks the
// widest vector V (16, 8, 4 or 2 bytes) that divides the row size and the pointers' alignment.
// Index type I: int32 or int64. Indices outside [0, rows_in) produce a zero row (never an out-of-bounds read).
//
// Memory traffic (P output rows of B bytes, I index bytes):
//   reads  P*I (indices) + P*B (source rows, random row order, each row contiguous)
//   writes P*B
// i.e. 2*P*B + P*I bytes; at P = 16k*8, D = 4096 bf16 that is ~2.1 GB -> ~0.5 ms at ~4 TB/s.
//
// Launch: one warp per output row (grid-stride over rows), lanes stride over the row's vectors, so each
// warp instruction moves 32 consecutive vectors (512 B at V = 16 B). blockDim.x must be a multiple of 32.

template <typename V, typename I>
__device__ __forceinline__ void gather_rows_impl(const V* __restrict__ x, const I* __restrict__ index,
                                                 V* __restrict__ out, long long rows_in, long long rows_out,
                                                 long long row_vecs) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long p = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < rows_out; p += warps) {
        const long long src = (long long)index[p];
        V* dst = out + p * row_vecs;
        if (src >= 0 && src < rows_in) {
            const V* from = x + src * row_vecs;
#pragma unroll 4
            for (long long j = lane; j < row_vecs; j += 32) dst[j] = from[j];
        } else {
            V zero = {};
            for (long long j = lane; j < row_vecs; j += 32) dst[j] = zero;
        }
    }
}

#define DS_COBALT_GATHER(NAME, V, I)                                                                  \
    extern "C" __global__ void NAME(const V* x, const I* index, V* out, long long rows_in,            \
                                    long long rows_out, long long row_vecs) {                         \
        gather_rows_impl<V, I>(x, index, out, rows_in, rows_out, row_vecs);                           \
    }

DS_COBALT_GATHER(gather_rows_v16_i32, uint4, int)
DS_COBALT_GATHER(gather_rows_v16_i64, uint4, long long)
DS_COBALT_GATHER(gather_rows_v8_i32, uint2, int)
DS_COBALT_GATHER(gather_rows_v8_i64, uint2, long long)
DS_COBALT_GATHER(gather_rows_v4_i32, unsigned int, int)
DS_COBALT_GATHER(gather_rows_v4_i64, unsigned int, long long)
DS_COBALT_GATHER(gather_rows_v2_i32, unsigned short, int)
DS_COBALT_GATHER(gather_rows_v2_i64, unsigned short, long long)
