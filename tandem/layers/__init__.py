"""Model building blocks: attention (paged, via kernels/), RMSNorm, rotary embeddings."""
