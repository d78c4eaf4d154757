"""Engine metrics scraping (vLLM, SGLang, TensorRT-LLM names) and pod health."""
