"""shardc.backends"""
