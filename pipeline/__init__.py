"""rackflow: pipeline."""
