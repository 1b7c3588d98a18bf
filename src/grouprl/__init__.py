"""grouprl: GRPO and its family (Dr. GRPO, DAPO, GSPO, RLOO) for Hugging Face causal LMs."""

__version__ = "0.1.0"
