"""Provenance workflow: manifest -> lock -> run -> bundle -> verify (see docs in each module)."""
