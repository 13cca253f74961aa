"""executor_service"""
