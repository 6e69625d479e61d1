"""The project's custom CPU kernels (the seeds' "NKI kernels" on this backend), built on first use.

Each kernel is C++ registered as a torch custom op (`torch.ops.vllm_neuron.*`) with a fake
implementation, so torch.compile keeps it as one call inside a bucket's graph. The shared object is
compiled once per machine with the system C++ compiler into `<cache root>/kernels/<hash>/` (the hash
covers the source, torch's version, the CPU variant and its flags, the compiler and the CPU's instruction
set: -march=native builds must never reach another CPU through a shared cache root) and reused by every
later start.

One build per CPU class (`VARIANTS`), picked from /proc/cpuinfo or forced with VLLM_NEURON_CPU_ISA:
`avx512bf16` (bf16 dot products in hardware), `avx2` (x86-64-v3: AVX2 + FMA; bf16 widened to fp32),
`generic` (baseline x86-64 / other architectures: attention only, compiler-vectorized).

`VLLM_NEURON_DISABLE_NKI_KERNELS=1` turns them off; so does a non-CPU device or a failed build
(logged once): the layers then take their pure-torch paths, which compute the same thing.

Modules: `build.py` (compile and load the shared object, once per machine and CPU class),
`cpu_caps.py` (what this CPU and build offer: variant, rows per kernel, tile kernels), `ops.py` (the ops'
Python wrappers and fake implementations), `triton_paged_decode.py` (the CUDA decode kernel).
"""
