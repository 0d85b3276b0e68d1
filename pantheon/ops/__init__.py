"""Ops: how a weight is stored and multiplied.

The GGUF block formats and their expanders (`quant_formats`), the weight type and the one product
(`weights.QuantWeight`, `weights.linear`), the native CPU kernels (`native/`) and the routed-expert
kernels (`moe_kernels`). Below every model: imports nothing of pantheon but the foundation.
"""
