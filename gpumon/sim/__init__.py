"""A simulated node and training job: the demo, and a GPU source where there is no driver."""
