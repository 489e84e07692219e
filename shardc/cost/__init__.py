"""shardc.cost"""
