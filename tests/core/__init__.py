"""Model, loader, sampling, scheduler, page pool, prefix cache and structured outputs."""
