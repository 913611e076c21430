"""sim layer of gpumon (see DESIGN: layering)."""
