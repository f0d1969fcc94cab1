// dedup_pairs: per-node dedup of (token, remote node) pairs for the inter-node dispatch stage.
// Output order is node-major, then token order (what dispatch.py's pair_NT.nonzero() gives).
//
// Memory traffic: three kernels, launched in order on one stream (T tokens, K routes, N nodes, P pairs, I = 4/8 index bytes):
//   dedup_mark_*    one thread per token: flags_NT[n, t] = 1 for every remote node n among its K routes
//                   (flags_NT zeroed by the launcher).
//                   reads T*K*I, writes <= T*min(K, N) bytes.
//   dedup_scan      one block per node: exclusive scan of flags_NT[n, :] -> pos_NT[n, t] (int32) and the
//                   node's pair count count_N[n] (int64, = rail_send_N).
//                   reads N*T bytes, writes N*T*4 + N*8 bytes.
//   (the launcher reads sum(count_N) to the host to size pair_token_P: the output shape depends on data)
//   dedup_compact_* one thread per route: pair_index_TK[t, k] = start[n] + pos_NT[n, t] (or -1 for
//                   local / dropped routes) and pair_token_P[that index] = t (every route of the same pair
//                   writes the same value, so the race is benign).
//                   reads T*K*I + T*K*4 (+ N*8 per thread, cached), writes T*K*8 + P*8 bytes.
// Total ~ T*K*(2*I + 12) + 5*N*T bytes (~3 MB at T = 16k, K = 8, N = 8, int64): launch-latency bound.
//
// Node ids outside [0, N) count as dropped (same as -1); the torch reference requires them in range.

template <typename I>
__device__ __forceinline__ void dedup_mark_impl(const I* __restrict__ dest_TK, long long T, int K,
                                                long long src_node, long long N,
                                                unsigned char* __restrict__ flags_NT) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < T; t += stride) {
        for (int k = 0; k < K; ++k) {
            const long long n = (long long)dest_TK[t * K + k];
            if (n >= 0 && n < N && n != src_node) flags_NT[n * T + t] = 1;
        }
    }
}

template <typename I>
__device__ __forceinline__ void dedup_compact_impl(const I* __restrict__ dest_TK, long long T, int K,
                                                   long long src_node, long long N,
                                                   const int* __restrict__ pos_NT,
                                                   const long long* __restrict__ count_N,
                                                   long long* __restrict__ pair_token_P,
                                                   long long* __restrict__ pair_index_TK) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long routes = T * K;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < routes; i += stride) {
        const long long n = (long long)dest_TK[i];
        long long pair = -1;
        if (n >= 0 && n < N && n != src_node) {
            const long long t = i / K;
            long long start = 0;
            for (long long m = 0; m < n; ++m) start += count_N[m];
            pair = start + pos_NT[n * T + t];
            pair_token_P[pair] = t;
        }
        pair_index_TK[i] = pair;
    }
}

extern "C" __global__ void dedup_mark_i32(const int* dest_TK, long long T, int K, long long src_node,
                                          long long N, unsigned char* flags_NT) {
    dedup_mark_impl<int>(dest_TK, T, K, src_node, N, flags_NT);
}
extern "C" __global__ void dedup_mark_i64(const long long* dest_TK, long long T, int K, long long src_node,
                                          long long N, unsigned char* flags_NT) {
    dedup_mark_impl<long long>(dest_TK, T, K, src_node, N, flags_NT);
}

// Block-wide exclusive scan of one int per thread; *total gets the block sum. blockDim.x: multiple of 32.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total, int* warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int s = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < warps) warp_sums[lane] = s;  // inclusive warp prefix
    }
    __syncthreads();
    const int before = warp > 0 ? warp_sums[warp - 1] : 0;
    *total = warp_sums[warps - 1];
    __syncthreads();  // warp_sums is reused by the next call
    return before + x - v;
}

#define DS_COBALT_SCAN_ITEMS 16

// grid = N blocks (one per node), any blockDim.x multiple of 32 up to 1024.
extern "C" __global__ void dedup_scan(const unsigned char* __restrict__ flags_NT, long long T,
                                      int* __restrict__ pos_NT, long long* __restrict__ count_N) {
    __shared__ int warp_sums[32];
    const long long n = blockIdx.x;
    const unsigned char* flags = flags_NT + n * T;
    int* pos = pos_NT + n * T;
    const long long tile = (long long)blockDim.x * DS_COBALT_SCAN_ITEMS;
    long long running = 0;
    for (long long base = 0; base < T; base += tile) {
        const long long first = base + (long long)threadIdx.x * DS_COBALT_SCAN_ITEMS;
        unsigned char f[DS_COBALT_SCAN_ITEMS];
        int mine = 0;
#pragma unroll
        for (int i = 0; i < DS_COBALT_SCAN_ITEMS; ++i) {
            f[i] = (first + i < T) ? flags[first + i] : 0;
            mine += f[i];
        }
        int total;
        int offset = (int)running + block_exclusive_scan(mine, &total, warp_sums);
#pragma unroll
        for (int i = 0; i < DS_COBALT_SCAN_ITEMS; ++i) {
            if (first + i < T) pos[first + i] = offset;  // exclusive position; only read where flagged
            offset += f[i];
        }
        running += total;
    }
    if (threadIdx.x == 0) count_N[n] = running;
}

extern "C" __global__ void dedup_compact_i32(const int* dest_TK, long long T, int K, long long src_node,
                                             long long N, const int* pos_NT, const long long* count_N,
                                             long long* pair_token_P, long long* pair_index_TK) {
    dedup_compact_impl<int>(dest_TK, T, K, src_node, N, pos_NT, count_N, pair_token_P, pair_index_TK);
}
extern "C" __global__ void dedup_compact_i64(const long long* dest_TK, long long T, int K, long long src_node,
                                             long long N, const int* pos_NT, const long long* count_N,
                                             long long* pair_token_P, long long* pair_index_TK) {
    dedup_compact_impl<long long>(dest_TK, T, K, src_node, N, pos_NT, count_N, pair_token_P, pair_index_TK);
}
