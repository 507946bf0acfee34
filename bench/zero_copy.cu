// How fast a GPU kernel reads page-locked host memory in place (zero-copy, over PCIe),
// beside the copy engine's upload and the GPU's own memory: what a missed routed expert
// costs if the GPU computes it straight from host RAM instead of handing it to the CPU.
// Also whether memory pinned with cudaHostRegister is mapped (device pointer == host
// pointer) under the flags patch 0005 uses and with cudaHostRegisterMapped added.
//   nvcc -O2 -arch=sm_90 -o zero_copy bench/zero_copy.cu && ./zero_copy
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// every thread reads 16-byte words strided over the grid, folded so nothing is optimised away
__global__ void read_all(const uint4 * p, size_t n, unsigned * sink) {
    unsigned s = 0;
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x9e3779b9u) {
        sink[0] = s;
    }
}

static float time_ms(cudaEvent_t a, cudaEvent_t b) { float ms; cudaEventElapsedTime(&ms, a, b); return ms; }

int main() {
    const size_t total = (size_t) 2 << 30;
    char * host = nullptr;
    if (posix_memalign((void **) &host, 4096, total)) { printf("no host memory\n"); return 1; }
    memset(host, 1, total);
    int use_host_ptr = 0;
    cudaDeviceGetAttribute(&use_host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, 0);
    printf("device can use the host pointer of registered memory: %d\n", use_host_ptr);

    // patch 0005's flags first (portable, read-only), then with mapped added
    const unsigned flags[2] = {cudaHostRegisterPortable | cudaHostRegisterReadOnly,
                               cudaHostRegisterPortable | cudaHostRegisterReadOnly | cudaHostRegisterMapped};
    void * dev_view = nullptr;
    for (unsigned f : flags) {
        CHECK(cudaHostRegister(host, total, f));
        void * d = nullptr;
        const cudaError_t e = cudaHostGetDevicePointer(&d, host, 0);
        printf("flags %u: device pointer %s%s\n", f, e == cudaSuccess ? "ok" : cudaGetErrorString(e),
               e == cudaSuccess && d == (void *) host ? " (== host pointer)" : "");
        if (e == cudaSuccess) dev_view = d;
        if (f != flags[1]) CHECK(cudaHostUnregister(host));
    }
    cudaGetLastError();
    if (!dev_view) { printf("no device view of host memory\n"); return 1; }

    unsigned * sink; char * vram;
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMalloc(&vram, total));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    // one expert of the 30B-A3B shape (Q4_0, 2.65 MB), of the reference width (Q2_K, 14.3 MB),
    // a layer's misses, and a large read
    const size_t sizes[] = {(size_t) 2650 << 10, (size_t) 14300 << 10, (size_t) 100 << 20, (size_t) 1 << 30};
    const int grids[] = {132, 528, 2112};
    const int reps = 5;
    for (size_t sz : sizes) {
        for (int g : grids) {
            read_all<<<g, 256>>>((const uint4 *) dev_view, sz / 16, sink);
            CHECK(cudaDeviceSynchronize());
            cudaEventRecord(e0);
            for (int r = 0; r < reps; ++r) {  // a different range each time: no cache reuse
                const size_t off = ((size_t) (r + 1) * sz) % (total - sz) / 4096 * 4096;
                read_all<<<g, 256>>>((const uint4 *) ((char *) dev_view + off), sz / 16, sink);
            }
            cudaEventRecord(e1); CHECK(cudaEventSynchronize(e1));
            const float ms = time_ms(e0, e1) / reps;
            printf("zero-copy read %8.2f MB, %4d blocks: %8.1f us, %6.1f GB/s\n", sz / 1e6, g, ms * 1e3, sz / ms / 1e6);
        }
        cudaEventRecord(e0);
        for (int r = 0; r < reps; ++r) cudaMemcpyAsync(vram, host, sz, cudaMemcpyHostToDevice);
        cudaEventRecord(e1); CHECK(cudaEventSynchronize(e1));
        float ms = time_ms(e0, e1) / reps;
        printf("upload (copy engine) %8.2f MB: %8.1f us, %6.1f GB/s\n", sz / 1e6, ms * 1e3, sz / ms / 1e6);
        cudaEventRecord(e0);
        for (int r = 0; r < reps; ++r) read_all<<<2112, 256>>>((const uint4 *) vram, sz / 16, sink);
        cudaEventRecord(e1); CHECK(cudaEventSynchronize(e1));
        ms = time_ms(e0, e1) / reps;
        printf("VRAM read %8.2f MB: %8.1f us, %6.1f GB/s\n", sz / 1e6, ms * 1e3, sz / ms / 1e6);
    }
    return 0;
}
