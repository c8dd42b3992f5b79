"""Multi-LoRA serving (vLLM's ``vllm/lora``): PEFT adapter folders read into the core's fused projections
(``adapter``), the loaded adapters and the per-step slots they occupy (``manager``), and the batched low-rank
update applied inside the projections (``layers``)."""
