"""shardc.frontends"""
