"""The elastic training program: data, model, sampler and the loop torchrun runs."""
