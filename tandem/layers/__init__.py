"""Model building blocks: attention over the paged cache, linear, norm, rotary, sampler."""
