// chunk_flags: per-chunk ready flags for the overlap scheduler.
//
// set_chunk_flag is launched (1 thread) on the communication stream right after a chunk's receive, so
// stream order guarantees the chunk's rows are complete when the flag changes. It publishes
// flags[chunk] = value (the scheduler's current epoch; flags are never cleared, a new step uses a larger
// epoch, so no reset kernel and no reset race). The system-scope fences make the receive's writes
// visible before the flag, to device-side pollers, to the host, and to a stream memory wait
// (cuStreamWaitValue32 GEQ epoch) when the driver path is available.
//
// Memory traffic: one 4-byte atomic store per call (launch latency dominates, a few microseconds).

extern "C" __global__ void set_chunk_flag(int* flags, long long chunk, int value) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence_system();
        atomicExch(flags + chunk, value);
        __threadfence_system();
    }
}
