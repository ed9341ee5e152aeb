"""The arithmetic of RLHF (advantages, clipped losses, KL) and reward functions named "module:function"."""
