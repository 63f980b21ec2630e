"""kvguard.migrations"""
