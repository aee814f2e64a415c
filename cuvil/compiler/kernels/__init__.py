"""The kernels part: the LLVM emitter every op lowers through and the micro-kernels they call,
one module per kernel family (docs/architecture.md). It sits below ops and knows nothing of
the graph: a kernel takes pointers, sizes and the module's CPU features.
"""
