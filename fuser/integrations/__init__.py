"""Integrations with training frameworks; each module imports its framework on use:
``fuser.integrations.transformers`` (Hugging Face ``Trainer`` and causal LMs),
``fuser.integrations.trl`` (TRL's ``GRPOTrainer``)."""
