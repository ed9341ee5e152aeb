"""PAI Megatron Cookbook helper package."""
