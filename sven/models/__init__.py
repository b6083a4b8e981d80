"""Memory-based temporal GNN models (TGN, JODIE, APAN, DyRep) and their building blocks."""
