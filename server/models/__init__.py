"""The served models: checkpoint folders loaded at start, and models added while serving."""
