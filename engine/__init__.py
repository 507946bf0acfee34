"""Everything that touches llama.cpp/ggml. Importing this package loads no native code:
the ctypes bindings are imported by `engine._capi` on first use."""
