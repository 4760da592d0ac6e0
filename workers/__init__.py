"""rackflow: workers."""
