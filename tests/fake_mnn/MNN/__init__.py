"""A stand-in for the MNN wheel (tests/test_bench_mnn.py): only ``MNN.llm`` is used."""
