"""Requests, scheduler, batch metadata, model runner, sampling and the Engine."""
