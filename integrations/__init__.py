"""Engines other than tooltrie's own, driven by the same batch state (``kernels/batch.py``): Hugging Face
``generate`` (``hf``) and vLLM's two model runners (``vllm``, which imports vLLM: ``pip install tooltrie[vllm]``)."""
