"""Export trained heads for serving engines (vLLM, SGLang, TensorRT-LLM) and read such exports
back."""
