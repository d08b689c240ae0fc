"""Adapters from rotkv to other tools: lm-evaluation-harness (``rotkv.integrations.lm_eval``) and
the OSCAR/SGLang rotation checkpoint export (``rotkv.integrations.oscar_export``)."""
