"""Runtime: a loaded model and the programs that run it.

The engine (`engine.Model`: params, compiled step programs, the verbs insert / step / release), the
donated decode state and the sampler inside the step, the tensor-parallel sharding plan, the compile
guard, host and device memory (watch and admission), pooling for embeddings, and the plain-loop
reference the tests and `pantheon generate` use.
"""
