"""analysis layer of gpumon (see DESIGN: layering)."""
