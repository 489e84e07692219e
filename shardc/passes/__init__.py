"""shardc.passes"""
