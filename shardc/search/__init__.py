"""shardc.search"""
