"""rackflow: streams."""
