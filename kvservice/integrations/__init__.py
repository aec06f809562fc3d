"""Engine integrations: each imports its engine only inside its own package."""
