"""Adapters from rotkv to other tools: lm-evaluation-harness (``rotkv.integrations.lm_eval``),
the OSCAR/SGLang rotation checkpoint export (``rotkv.integrations.oscar_export``) and the vLLM attention
backend (``rotkv.integrations.vllm``)."""
