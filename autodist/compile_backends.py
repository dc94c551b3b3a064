"""The ``torch.compile`` backends a plan may name, apart from ``autodist.plan`` so that the CLI can
offer them without importing torch."""

# torch.compile backends a plan may name for its compiled blocks: inductor (torch's default, fused
# kernels), aot_eager (the same graph capture and autograd split, kernels run eagerly: no C++ or
# Triton compiler needed) and eager (graph capture only)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
