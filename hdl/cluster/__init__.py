"""Systems of clusters: fabrics joined by credit-flow-controlled bridges."""
