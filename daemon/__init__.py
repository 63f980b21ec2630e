"""kvguard.daemon"""
